// The MoE layer's dispatch at decode sizes, as one XLA FFI custom call: the (token, slot)
// pairs sorted stably by expert, and x's rows gathered in that order.
//
// For R = T * k pairs (pair p = token * k + slot) with expert ids in topk_ids (T, k):
//   key[p]         = id if 0 <= id < E, else E (such a pair sorts last, in no group)
//   inverse[p]     = the pair's row in the stable sort by key
//                  = start[key[p]] + #{q < p : key[q] == key[p]}
//   order[r]       = the pair of sorted row r (inverse's inverse), token[r] = order[r] / k
//   group_sizes[e] = #{p : key[p] == e}, e < E
//   rows[r]        = x[token[r]]
// bit for bit what pallas_gemm/moe/layer.py computes in XLA (a counting or an argsort
// dispatch and a gather), where that is several kernels and their launch gaps: at a decode
// step's 1024 pairs each of those takes a few microseconds around grouped GEMMs of
// 0.1-0.2 ms. The Python twin is pallas_gemm/moe/cuda_dispatch.py.
//
// Design: every block ranks all R <= 4096 pairs on its own (R int32 keys are read from L2,
// a few microseconds), then copies its share of the rows; block 0 also writes the integer
// outputs. Ranking is stable without a sort, 1024 pairs at a time (one per thread):
//   * within a warp, __match_any_sync gives the lanes holding the same key; a pair's rank
//     there is the number of those lanes below it;
//   * each warp's count per key goes to shared memory (one byte: at most 32), and a pair
//     adds the counts of the warps before its own, and the running count of its key over
//     the earlier chunks of 1024;
//   * a block-wide exclusive scan of the per-key totals gives each key's first row.
// Shared memory: 32 x 512 bytes of warp counts, 3 x 512 ints, R ints of the sorted order:
// 37 KiB, under the 48 KiB a block gets without opting in. Hence E + 1 <= 512 keys.
// Rows are copied in 16-byte vectors where the row's bytes allow it, else narrower.
//
// Layers (as in jax's examples/ffi): device code -> typed launcher -> FFI handler.

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include <cub/block/block_scan.cuh>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define PALLAS_GEMM_EXPORT extern "C" __attribute__((visibility("default")))

namespace pallas_gemm {

constexpr int kThreads = 1024;              // one pair per thread and chunk
constexpr int kWarps = kThreads / 32;
constexpr int kMaxPairs = 4096;             // sorted order held in shared memory
constexpr int kChunks = kMaxPairs / kThreads;
constexpr int kMaxKeys = 512;               // E + 1 (the last key: ids outside [0, E))

struct DispatchArgs {
  const int32_t* ids;      // (R,)
  const char* x;           // (T, row_bytes)
  char* rows;              // (R, row_bytes)
  int32_t* order;          // (R,)
  int32_t* token;          // (R,)
  int32_t* inverse;        // (R,)
  int32_t* group_sizes;    // (E,)
  int pairs;               // R
  int k;                   // slots per token
  int experts;             // E
  int64_t row_bytes;       // bytes of one row of x, a multiple of sizeof(Vec)
};

template <typename Vec>
__global__ void __launch_bounds__(kThreads) DispatchKernel(DispatchArgs a) {
  __shared__ uint8_t warp_counts[kWarps][kMaxKeys];
  __shared__ int32_t counts[kMaxKeys];   // per key, over the chunks ranked so far
  __shared__ int32_t starts[kMaxKeys];   // per key, its first sorted row
  __shared__ int32_t sorted[kMaxPairs];  // the pair of each sorted row
  using Scan = cub::BlockScan<int32_t, kThreads>;
  __shared__ typename Scan::TempStorage scan_storage;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int keys = a.experts + 1;
  const bool writer = blockIdx.x == 0;
  for (int e = tid; e < keys; e += kThreads) counts[e] = 0;
  for (int i = tid; i < kWarps * keys; i += kThreads) warp_counts[i / keys][i % keys] = 0;
  __syncthreads();

  // Rank each pair among the earlier pairs of its key. `chunks` is the same in every
  // thread, so the barriers inside the loop are reached by the whole block.
  const int chunks = (a.pairs + kThreads - 1) / kThreads;
  int key[kChunks], rank[kChunks];
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c >= chunks) break;
    const int p = c * kThreads + tid;
    const bool live = p < a.pairs;
    int kk = -1;  // threads past R group together and are never counted
    if (live) {
      const int id = a.ids[p];
      kk = (id >= 0 && id < a.experts) ? id : a.experts;
    }
    const unsigned peers = __match_any_sync(0xffffffffu, kk);
    const int below = __popc(peers & ((1u << lane) - 1u));
    if (live && below == 0) warp_counts[warp][kk] = static_cast<uint8_t>(__popc(peers));
    __syncthreads();
    int r = 0;
    if (live) {
      r = counts[kk] + below;
      for (int w = 0; w < warp; ++w) r += warp_counts[w][kk];
    }
    __syncthreads();  // every read of this chunk's counts is done
    for (int e = tid; e < keys; e += kThreads) {
      int sum = 0;
      for (int w = 0; w < kWarps; ++w) {
        sum += warp_counts[w][e];
        warp_counts[w][e] = 0;
      }
      counts[e] += sum;
    }
    __syncthreads();
    key[c] = kk;
    rank[c] = r;
  }

  // Each key's first row: an exclusive scan of the totals (one key per thread).
  const int32_t total = tid < keys ? counts[tid] : 0;
  int32_t start;
  Scan(scan_storage).ExclusiveSum(total, start);
  if (tid < keys) starts[tid] = start;
  if (writer && tid < a.experts) a.group_sizes[tid] = total;
  __syncthreads();
#pragma unroll
  for (int c = 0; c < kChunks; ++c) {
    if (c >= chunks) break;
    const int p = c * kThreads + tid;
    if (p < a.pairs) {
      const int row = starts[key[c]] + rank[c];
      sorted[row] = p;
      if (writer) a.inverse[p] = row;
    }
  }
  __syncthreads();
  if (writer) {
    for (int r = tid; r < a.pairs; r += kThreads) {
      a.order[r] = sorted[r];
      a.token[r] = sorted[r] / a.k;
    }
  }

  // This block's rows: a contiguous share of the R sorted rows, copied Vec by Vec.
  const int per_block = (a.pairs + gridDim.x - 1) / gridDim.x;
  const int first = blockIdx.x * per_block;
  const int last = min(a.pairs, first + per_block);
  if (first >= last) return;
  const int64_t vecs = a.row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t count = (last - first) * vecs;
  const Vec* x = reinterpret_cast<const Vec*>(a.x);
  Vec* rows = reinterpret_cast<Vec*>(a.rows);
  for (int64_t i = tid; i < count; i += kThreads) {
    const int64_t r = first + i / vecs, v = i % vecs;
    const int64_t t = sorted[r] / a.k;
    rows[r * vecs + v] = x[t * vecs + v];
  }
}

template <typename Vec>
cudaError_t LaunchDispatch(const DispatchArgs& args, int blocks, cudaStream_t stream) {
  DispatchKernel<Vec><<<blocks, kThreads, 0, stream>>>(args);
  return cudaGetLastError();
}

static std::string Dims(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) s += (i ? ", " : "") + std::to_string(dims[i]);
  return s + ")";
}

static bool Aligned(const void* p, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0;
}

ffi::Error DispatchImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer x,
                        ffi::Result<ffi::Buffer<ffi::S32>> order,
                        ffi::Result<ffi::Buffer<ffi::S32>> token,
                        ffi::Result<ffi::Buffer<ffi::S32>> inverse,
                        ffi::Result<ffi::Buffer<ffi::S32>> group_sizes,
                        ffi::Result<ffi::AnyBuffer> rows, int64_t k, int64_t experts,
                        int64_t blocks) {
  const char* name = "pallas_gemm_moe_dispatch: ";
  const int64_t pairs = ids.element_count();
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2 || k < 1 || pairs % k || x_dims[0] != pairs / k) {
    return ffi::Error::InvalidArgument(std::string(name) + "x must be (T, D) with T * k = " +
                                       std::to_string(pairs) + " pairs, k = " +
                                       std::to_string(k) + "; got x" + Dims(x_dims));
  }
  if (pairs < 1 || pairs > kMaxPairs || experts < 1 || experts + 1 > kMaxKeys || blocks < 1) {
    return ffi::Error::InvalidArgument(
        std::string(name) + "needs 1 <= pairs <= " + std::to_string(kMaxPairs) +
        ", 1 <= experts < " + std::to_string(kMaxKeys) + " and blocks >= 1; got " +
        std::to_string(pairs) + ", " + std::to_string(experts) + ", " + std::to_string(blocks));
  }
  if (rows->element_type() != x.element_type() || rows->element_count() != pairs * x_dims[1] ||
      order->element_count() != pairs || token->element_count() != pairs ||
      inverse->element_count() != pairs || group_sizes->element_count() != experts) {
    return ffi::Error::InvalidArgument(std::string(name) + "result shapes or dtypes do not "
                                       "match (R, D) rows of x's dtype, (R,) and (E,) ints");
  }
  DispatchArgs args;
  args.ids = ids.typed_data();
  args.x = static_cast<const char*>(x.untyped_data());
  args.rows = static_cast<char*>(rows->untyped_data());
  args.order = order->typed_data();
  args.token = token->typed_data();
  args.inverse = inverse->typed_data();
  args.group_sizes = group_sizes->typed_data();
  args.pairs = static_cast<int>(pairs);
  args.k = static_cast<int>(k);
  args.experts = static_cast<int>(experts);
  args.row_bytes = static_cast<int64_t>(x.size_bytes()) / x_dims[0];
  const int grid = static_cast<int>(blocks < pairs ? blocks : pairs);
  // The widest copy that every row start (base + t * row_bytes) is aligned to.
  auto fits = [&](int64_t bytes) {
    return args.row_bytes % bytes == 0 && Aligned(args.x, bytes) && Aligned(args.rows, bytes);
  };
  cudaError_t err;
  if (fits(16)) {
    err = LaunchDispatch<uint4>(args, grid, stream);
  } else if (fits(8)) {
    err = LaunchDispatch<uint2>(args, grid, stream);
  } else if (fits(4)) {
    err = LaunchDispatch<uint32_t>(args, grid, stream);
  } else if (fits(2)) {
    err = LaunchDispatch<uint16_t>(args, grid, stream);
  } else {
    err = LaunchDispatch<uint8_t>(args, grid, stream);
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(name) + "CUDA error: " + cudaGetErrorName(err) +
                                ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace pallas_gemm

// Declared first so the symbol is exported despite -fvisibility=hidden.
PALLAS_GEMM_EXPORT XLA_FFI_Error* PallasGemmMoeDispatch(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PallasGemmMoeDispatch, pallas_gemm::DispatchImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()
        .Arg<ffi::Buffer<ffi::S32>>()   // ids: (T, k) expert ids, any value
        .Arg<ffi::AnyBuffer>()          // x: (T, D)
        .Ret<ffi::Buffer<ffi::S32>>()   // order: (R,)
        .Ret<ffi::Buffer<ffi::S32>>()   // token: (R,)
        .Ret<ffi::Buffer<ffi::S32>>()   // inverse: (R,)
        .Ret<ffi::Buffer<ffi::S32>>()   // group_sizes: (E,)
        .Ret<ffi::AnyBuffer>()          // rows: (R, D), x's dtype
        .Attr<int64_t>("k")             // slots per token
        .Attr<int64_t>("experts")       // E
        .Attr<int64_t>("blocks"));      // grid size (each block ranks every pair)

// For the Python twin: the limits compiled in (pairs, keys = E + 1).
PALLAS_GEMM_EXPORT int pallas_gemm_moe_dispatch_max_pairs() { return pallas_gemm::kMaxPairs; }
PALLAS_GEMM_EXPORT int pallas_gemm_moe_dispatch_max_keys() { return pallas_gemm::kMaxKeys; }
