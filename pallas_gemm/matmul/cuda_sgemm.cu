// Register-tiled FP32 GEMM (SGEMM) for NVIDIA GPUs as an XLA FFI custom call.
//
// out[i] = alpha * op(A[i]) @ op(B[i / b_div]) + beta * C[i]   for every batch entry i,
// where op(A) is M×K, op(B) is K×N, and every matrix is row-major (C order).
// The Python twin is pallas_gemm/matmul/cuda.py.
//
// Design: the register-tiled SGEMM of "Matrix Multiplication on GPU, Part 2: Tiling"
// (lawmurray/gpu-gemm), generalised to any shape, layout and batch:
//   * A thread block computes BM×BN output tiles (256×128 in that design's configuration),
//     numbered along a generalised Hilbert curve, so the blocks resident at one time
//     share rows of A and columns of B in L2. Where whole tiles would leave block slots
//     idle in the last wave, the last waves are shared out by K-slices (stream-K) and
//     the tiles cut between blocks are summed through a scratch buffer (see Schedule).
//   * op(A) and op(B) are consumed in K-slices of BK: a BK×BM slice of op(A)^T and a
//     BK×BN slice of op(B) per stage, copied with cp.async through a STAGES-deep ring.
//     Both operands are stored k-major in shared memory (sA[k][m], sB[k][n]) so one k
//     step reads four consecutive m (or n) as one 128-bit load.
//       - Global memory that is already k-major (A when transpose_a, B when not
//         transpose_b) is copied 16 bytes at a time (see SliceLoader).
//       - Global memory that is K-contiguous (A when not transpose_a, B when
//         transpose_b) is transposed on the way in: 128-bit read-only global loads
//         into registers, issued one K-slice before they are written to shared
//         memory with 4 scalar stores each (see RegSliceLoader). Rows are padded by
//         4 floats so the transposed writes of a warp hit 32 different banks.
//     Both need every stored row and base pointer 16-byte aligned: cuda.py pads rows
//     to multiples of 4 floats, and the handler refuses anything else.
//     So the usual C = A @ B (row-major) transposes A and copies B straight; that is
//     the mirror image of the original design, which is column-major and transposes B.
//   * Each warp owns a WM×WN sub-tile. The warps of one warp-row load that row's slice
//     of A and the warps of one warp-column load that column's slice of B; one
//     block-wide bar.sync per K-slice publishes a landed stage and frees a read one.
//     The main loop is a single basic block with register double-buffered fragments
//     (see SgemmTiledKernel).
//   * Each thread accumulates TM×TN outputs in registers from TM/4 float4 fragments of A
//     and TN/4 float4 fragments of B per k step. The fragments of one thread are
//     32 (or 16) floats apart, so a warp's 128-bit shared loads are contiguous and free
//     of bank conflicts.
//   * Edges: cp.async with a source size below the copy size zero-fills the rest, so the
//     tail K-slice and the ragged M/N edges load zeros; the epilogue masks its stores.
//   * beta == 0 never reads C (NaN in C does not leak); cuda.py then passes a 1-element
//     placeholder for C. Offsets use 64-bit integers; M, N, K are each below 2^31.
//   * Batch: every leading dim is a batch dim (vmap_method="broadcast_all" adds them);
//     B's leading dims may end in 1s (a B shared across the batch: stride 0 in effect).
//
// Layers (as in jax's examples/ffi): device code -> typed launchers -> FFI handler.

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

#define PALLAS_GEMM_EXPORT extern "C" __attribute__((visibility("default")))

namespace pallas_gemm {

// ---------------------------------------------------------------------------
// Tile order: generalised Hilbert curve ("gilbert", J. Červený; the index-to-point
// form by abetusk, BSD-2-Clause), written as a loop because every recursive call is
// a tail call. It is a bijection from [0, w*h) onto the w×h grid for any w, h >= 1,
// and consecutive indices are neighbours (one diagonal step at most when w and h
// are both odd). Host and device run the same code; the host copy is exported for
// the CPU test.
// ---------------------------------------------------------------------------

__host__ __device__ inline int Sign(int v) { return (v > 0) - (v < 0); }
__host__ __device__ inline int Abs(int v) { return v < 0 ? -v : v; }

// Point (x, y) of the w×h grid at position idx along the curve. Requires
// 0 <= idx < w*h <= INT32_MAX.
__host__ __device__ inline void GilbertD2XY(int idx, int w, int h, int* x_out,
                                            int* y_out) {
  int x = 0, y = 0;
  // (ax, ay): major axis, (bx, by): minor axis of the current sub-rectangle.
  int ax, ay, bx, by;
  if (w >= h) {
    ax = w; ay = 0; bx = 0; by = h;
  } else {
    ax = 0; ay = h; bx = w; by = 0;
  }
  int cur = 0;
  while (true) {
    const int ww = Abs(ax + ay);
    const int hh = Abs(bx + by);
    const int dax = Sign(ax), day = Sign(ay);  // unit major direction
    const int dbx = Sign(bx), dby = Sign(by);  // unit minor direction
    const int di = idx - cur;
    if (hh == 1) {
      x += dax * di; y += day * di;
      break;
    }
    if (ww == 1) {
      x += dbx * di; y += dby * di;
      break;
    }
    // Floor division by 2 (arithmetic shift), as in the reference.
    int ax2 = ax >> 1, ay2 = ay >> 1;
    int bx2 = bx >> 1, by2 = by >> 1;
    const int w2 = Abs(ax2 + ay2);
    const int h2 = Abs(bx2 + by2);
    if (2 * ww > 3 * hh) {
      // Long rectangle: split the major axis in two.
      if ((w2 & 1) && ww > 2) {  // prefer even steps
        ax2 += dax; ay2 += day;
      }
      const int nxt = cur + Abs((ax2 + ay2) * (bx + by));
      if (idx < nxt) {
        ax = ax2; ay = ay2;
        continue;
      }
      cur = nxt;
      x += ax2; y += ay2;
      ax -= ax2; ay -= ay2;
      continue;
    }
    if ((h2 & 1) && hh > 2) {  // prefer even steps
      bx2 += dbx; by2 += dby;
    }
    // Standard case: one step up, one long step across, one step down.
    int nxt = cur + Abs((bx2 + by2) * (ax2 + ay2));
    if (idx < nxt) {
      const int tax = ax2, tay = ay2;
      ax = bx2; ay = by2;
      bx = tax; by = tay;
      continue;
    }
    cur = nxt;
    nxt = cur + Abs((ax + ay) * ((bx - bx2) + (by - by2)));
    if (idx < nxt) {
      x += bx2; y += by2;
      bx -= bx2; by -= by2;
      continue;
    }
    cur = nxt;
    x += (ax - dax) + (bx2 - dbx);
    y += (ay - day) + (by2 - dby);
    const int nax = -bx2, nay = -by2;
    const int nbx = -(ax - ax2), nby = -(ay - ay2);
    ax = nax; ay = nay; bx = nbx; by = nby;
  }
  *x_out = x;
  *y_out = y;
}

// ---------------------------------------------------------------------------
// Problem description, passed by value in the kernel parameter space.
// ---------------------------------------------------------------------------

struct GemmArgs {
  const float* a;          // batch entry 0 of A: (M, K), or (K, M) when transpose_a
  const float* b;          // batch entry 0 of B: (K, N), or (N, K) when transpose_b
  const float* c;          // batch entry 0 of C: (M, N); never read when beta == 0
  float* out;              // (batch, M, N)
  int m, n, k;             // each < 2^31 - 256 (checked by the handler)
  int64_t lda, ldb;        // elements between consecutive stored rows of A, B (>= the
                           // row length: cuda.py pads rows to 16 bytes)
  int64_t a_stride, b_stride;  // elements between consecutive batch entries of A, B
  int64_t batch;           // number of output matrices
  int64_t b_div;           // output entry i uses B entry i / b_div (batch when B is shared)
  float alpha, beta;
  bool out_vec;            // 16-byte loads of C / stores of out allowed
};

// ---------------------------------------------------------------------------
// Work schedule: which (tile, K-slice range) pieces each block computes, in order.
//
// Tiles are numbered batch entry by batch entry (t = entry * tiles_per_entry + index
// along the Hilbert curve), each split into `slices` K-slices of BK. Two parts:
//   * data-parallel: tiles [0, dp_tiles), block c computes tiles c, c + G, c + 2G, ...
//     (G = gridDim.x) whole, as a plain grid of one tile per block would;
//   * stream-K: the remaining tiles' sk_slices K-slices, laid end to end (tile-major),
//     cut into G equal ranges, range c for block c. A tile cut between blocks is
//     summed through `partials`: the piece holding the tile's last K-slice (the
//     "finisher") adds the pieces of the blocks before it, then writes the tile.
// Why: a grid of whole tiles leaves slots idle in its last wave (4096^3 with 128x128
// tiles at 2 blocks per SM on 132 SMs: 1024 tiles = 3.88 waves, the last 12% idle);
// the stream-K part gives every resident block the same number of K-slices. The
// data-parallel waves before it keep the tile order, and with it L2 reuse.
//
// Each block walks its stream-K range from the end (after its whole tiles). Its first
// stream-K piece ends where its range ends: if that is inside a tile, the piece lacks
// the tile's last slice and is published at once (partials[c], then flags[c]); every
// later piece ends on a tile boundary and so holds its tile's last slice. A tile's
// finisher therefore waits only for blocks with lower indices, and only for the first
// stream-K piece of each, which waits for nothing: no cycle. (A block whose range ends
// on a tile boundary publishes nothing and nobody waits for it.) Like other stream-K
// kernels this assumes the blocks with lower indices get scheduled, which holds when
// the grid fits the GPU at once, as it does here (one block per resident slot), and
// with in-order block dispatch.
// ---------------------------------------------------------------------------

struct Schedule {
  int64_t dp_tiles;    // tiles computed whole, one per block in turn
  int64_t sk_slices;    // K-slices of the stream-K part (0: none)
  int slices;          // K-slices per tile
  float* partials;     // gridDim.x x (BM x BN) floats, one piece per block
  unsigned* flags;     // gridDim.x; flags[c] != 0: partials[c] is complete
};

// First stream-K slice of block c (absolute: dp_tiles * slices + c * sk_slices / G).
__host__ __device__ inline int64_t StreamKBegin(const Schedule& s, int64_t c, int64_t grid) {
  return s.dp_tiles * s.slices + c * s.sk_slices / grid;
}

// Piece `item` (0, 1, ...) of block c's work: tile, and K-slices [slice_begin,
// slice_end) of it. Returns false past the block's last piece.
__host__ __device__ inline bool WorkItem(const Schedule& s, int64_t c, int64_t grid,
                                         int64_t item, int64_t* tile, int* slice_begin,
                                         int* slice_end) {
  const int64_t dp_items = c < s.dp_tiles ? (s.dp_tiles - 1 - c) / grid + 1 : 0;
  if (item < dp_items) {
    *tile = c + item * grid;
    *slice_begin = 0;
    *slice_end = s.slices;
    return true;
  }
  if (s.sk_slices == 0) return false;
  item -= dp_items;
  const int64_t begin = StreamKBegin(s, c, grid), end = StreamKBegin(s, c + 1, grid);
  // Walking back from the end: the first piece ends at `end`, the others at tile ends.
  const int64_t t = (end - 1) / s.slices - item;
  const int64_t tile_start = t * s.slices;
  const int64_t piece_end = item == 0 ? end : tile_start + s.slices;
  if (piece_end <= begin) return false;
  *tile = t;
  *slice_begin = int((begin > tile_start ? begin : tile_start) - tile_start);
  *slice_end = int(piece_end - tile_start);
  return true;
}

// ---------------------------------------------------------------------------
// cp.async, global and shared loads, stream-K flags.
// ---------------------------------------------------------------------------

__device__ __forceinline__ uint32_t SmemAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// 16-byte copy of which the first src_bytes come from global memory, the rest zero.
__device__ __forceinline__ void CpAsync16(uint32_t dst_smem, const float* src_gmem,
                                          int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst_smem),
               "l"(src_gmem), "r"(src_bytes));
}

__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}

template <int kPending>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// 128-bit read-only global load, or zeros (and no read) when !valid. Predicated in
// PTX so the main loop stays one basic block; volatile so it is issued where it is
// written (early in a slice), not sunk towards its use.
__device__ __forceinline__ void LoadGlobal4(float4& v, const float* src, bool valid) {
  asm volatile(
      "{\n"
      "  .reg .pred p;\n"
      "  setp.ne.b32 p, %5, 0;\n"
      "  mov.b32 %0, 0;\n"
      "  mov.b32 %1, 0;\n"
      "  mov.b32 %2, 0;\n"
      "  mov.b32 %3, 0;\n"
      "  @p ld.global.nc.v4.f32 {%0, %1, %2, %3}, [%4];\n"
      "}\n"
      : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
      : "l"(src), "r"(int(valid)));
}

// 128-bit shared load at a shared-window byte address. "memory" keeps it after the
// barriers that precede it in program order.
__device__ __forceinline__ float4 LoadShared4(uint32_t addr) {
  float4 v;
  asm volatile("ld.shared.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr)
               : "memory");
  return v;
}

// Stream-K flags (see Schedule): a release store after the block's partial sums, an
// acquire load (polled) before another block reads them.
__device__ __forceinline__ void SignalFlag(unsigned* flag) {
  asm volatile("st.release.gpu.global.u32 [%0], %1;\n" ::"l"(flag), "r"(1u) : "memory");
}

__device__ __forceinline__ void WaitFlag(const unsigned* flag) {
  for (;;) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(v) : "l"(flag) : "memory");
    if (v != 0) return;
    __nanosleep(100);
  }
}

// ---------------------------------------------------------------------------
// Tile configuration.
// ---------------------------------------------------------------------------

template <int BM_, int BN_, int BK_, int WM_, int WN_, int TM_, int TN_, int STAGES_,
          int MIN_BLOCKS_>
struct TileConfig {
  static constexpr int BM = BM_, BN = BN_, BK = BK_;  // block tile, K-slice
  static constexpr int WM = WM_, WN = WN_;            // warp tile
  static constexpr int TM = TM_, TN = TN_;            // thread tile
  static constexpr int STAGES = STAGES_;              // cp.async ring depth
  static constexpr int kMinBlocks = MIN_BLOCKS_;      // per SM, caps registers

  static constexpr int kWarpsM = BM / WM, kWarpsN = BN / WN;
  static constexpr int kThreads = 32 * kWarpsM * kWarpsN;
  static constexpr int kThreadsM = WM / TM;  // threads of a warp along m
  static constexpr int kThreadsN = WN / TN;  // threads of a warp along n
  static constexpr int kFragsM = TM / 4, kFragsN = TN / 4;  // float4 fragments
  static constexpr int kPad = 4;  // floats; makes transposed stores conflict-free
  static constexpr int kLdsA = BM + kPad;  // floats between k rows of sA
  static constexpr int kLdsB = BN + kPad;  // floats between k rows of sB
  static constexpr int kGroupA = 32 * kWarpsN;  // threads that load one warp-row of A
  static constexpr int kGroupB = 32 * kWarpsM;  // threads that load one warp-column of B
  // Floats between stages, the same for A and B and a power of two, so one running
  // byte counter masked with (STAGES * stage bytes - 1) addresses every stage of both
  // operands (see the main loop). It costs shared memory (128x128: 64 KB per block
  // instead of 34 KB) and saves the stage-index arithmetic; with the FFMA order of
  // OuterProduct it measured +2.5% at 4096^3 and 8192^3.
  static constexpr int kStageFloats = [] {
    int p = 1;
    while (p < BK * kLdsA || p < BK * kLdsB) p *= 2;
    return p;
  }();
  static constexpr size_t kSmemBytes = sizeof(float) * size_t(STAGES) * 2 * kStageFloats;

  static_assert(BM % WM == 0 && BN % WN == 0, "the block tile must be a grid of warp tiles");
  static_assert(kThreads <= 1024, "at most 1024 threads per block");
  static_assert(WM % TM == 0 && WN % TN == 0, "the warp tile must be a grid of thread tiles");
  static_assert(kThreadsM * kThreadsN == 32, "a warp tile holds exactly 32 thread tiles");
  static_assert(TM % 4 == 0 && TN % 4 == 0,
                "thread tiles are built from float4 fragments (128-bit shared loads)");
  static_assert(BM % 32 == 0 && BN % 32 == 0,
                "row strides of BM+4 / BN+4 floats spread a warp's transposed stores "
                "over all 32 banks only when BM and BN are multiples of 32");
  static_assert((BK * WM / 4) % kGroupA == 0 && (BK * WN / 4) % kGroupB == 0,
                "the 16-byte copies of a slice divide evenly among its loading threads");
  static_assert(kGroupA % (WM / 4) == 0 && kGroupB % (WN / 4) == 0,
                "a k-major operand copied 16 bytes at a time keeps one float4 column per thread");
  static_assert(STAGES >= 2, "the cp.async ring needs one stage in use and one in flight");
  static_assert((STAGES & (STAGES - 1)) == 0,
                "stages are addressed with a running counter masked to STAGES stages");
  static_assert(TM * TN <= 128, "more accumulators than this spill on a 255-register budget");
};

// ---------------------------------------------------------------------------
// Global -> shared copy of a k-major operand's K-slices for one thread (16 bytes a copy).
//
// The operand is viewed as op(X): K × extent, where x indexes M (for A) or N (for B),
// held in global memory as k-rows of contiguous x (element (k, x) at k*ld + x) and
// stored the same way in shared memory: s[k][x], kLds floats between k rows. Only the
// kWidth columns of this thread's warp-row (A) or warp-column (B) are copied, by the
// kGroup threads that share them: float4 column t % (kWidth/4), k = t / (kWidth/4) +
// i*kDk. The loader keeps only this thread's position; the problem constants (ld,
// extent, K) are re-read from the kernel parameters at each use, which costs no
// registers across the main loop.
// ---------------------------------------------------------------------------

template <int BK, int kWidth, int kGroup, int kLds>
struct SliceLoader {
  static constexpr int kDk = kGroup / (kWidth / 4);
  static constexpr int kCopies = BK * kWidth / (4 * kGroup);

  const float* gptr;  // this thread's first element of the next K-slice
  uint32_t sdst;      // shared byte address of this thread's first copy in stage 0
  int x;              // global x of this thread's first copy
  int kk;             // k of this thread's first copy within a slice

  // matrix: this batch entry's operand; k_origin: global k of the first slice to
  // load; x_origin: global x of the group's first column; s_col: its column in shared
  // memory; t: rank in the group (< kGroup).
  __device__ __forceinline__ SliceLoader(const float* matrix, int64_t ld, int k_origin,
                                         int x_origin, int s_col, int t,
                                         const float* s_stage0) {
    const int xl = 4 * (t % (kWidth / 4));
    kk = t / (kWidth / 4);
    gptr = matrix + int64_t(k_origin + kk) * ld + (x_origin + xl);
    x = x_origin + xl;
    sdst = SmemAddress(s_stage0 + kk * kLds + s_col + xl);
  }

  // Issues the copies of the K-slice starting at global k0 into the stage at byte
  // offset stage_bytes, then advances to the next slice. Elements outside the
  // extent × k_total operand become zeros; their copies read nothing and point at
  // `fallback` (a valid address) rather than past the end, so a slice at or past
  // k_total (the pipeline's tail) is all zeros and reads nothing.
  __device__ __forceinline__ void Load(uint32_t stage_bytes, int k0, int64_t ld,
                                       int extent, int k_total, const float* fallback) {
    const uint32_t dst = sdst + stage_bytes;
    // Opaque here, so the compiler neither hoists the per-copy strides (i * ld) out
    // of the main loop nor turns each copy's address into its own induction
    // variable: either would hold ~2 registers per copy across the whole loop.
    asm volatile("" : "+l"(ld));
    const float* p = gptr;
    const int bytes = 4 * max(0, min(4, extent - x));
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const int n = k0 + kk + i * kDk < k_total ? bytes : 0;
      CpAsync16(dst + 4 * i * kDk * kLds, n ? p : fallback, n);
      p += kDk * ld;
    }
    gptr += BK * ld;
  }
};

// ---------------------------------------------------------------------------
// Register-staged copy of a K-contiguous operand (global element (k, x) at x*ld + k;
// ld == K, K % 4 == 0 and the base 16-byte aligned, so a float4 at a k that is a
// multiple of 4 is either wholly inside the operand or wholly past K). Fetch issues
// 128-bit read-only global loads of one K-slice into registers;
// Store, called one K-slice later (so the global latency hides behind a whole slice
// of FFMAs), writes them transposed into the k-major stage: 4 scalar shared stores
// per float4.
// Thread t of the group owns row x = t % kWidth and the float4s at
// k = 4*(t / kWidth) + i*kDk of each slice. A warp's 32 threads have 32 consecutive
// x and the same k, so each store instruction writes 32 consecutive words of one
// k row: no bank conflict. All the copies of a thread read one row, so one pointer
// serves them all.
// ---------------------------------------------------------------------------

template <int BK, int kWidth, int kGroup, int kLds>
struct RegSliceLoader {
  static_assert(kGroup % kWidth == 0, "each thread of the group keeps one row");
  static_assert(BK % 4 == 0 && (BK / 4) % (kGroup / kWidth) == 0,
                "the float4s of a slice's rows divide evenly among the group");
  static constexpr int kDk = 4 * (kGroup / kWidth);  // k between a thread's float4s
  static constexpr int kCopies = BK / kDk;

  const float* gptr;  // this thread's first float4 of the next K-slice to fetch
  uint32_t sdst;      // shared byte address of its first float (k = kq) in stage 0
  int x;              // global row
  int kq;             // k of the first float4 within a slice
  float4 buf[kCopies];

  // The same arguments as SliceLoader's.
  __device__ __forceinline__ RegSliceLoader(const float* matrix, int64_t ld, int k_origin,
                                            int x_origin, int s_col, int t,
                                            const float* s_stage0) {
    const int xl = t % kWidth;
    kq = 4 * (t / kWidth);
    x = x_origin + xl;
    gptr = matrix + int64_t(x) * ld + (k_origin + kq);
    sdst = SmemAddress(s_stage0 + kq * kLds + s_col + xl);
  }

  // Loads the K-slice starting at global k0 (zeros outside the operand, without
  // reading) and advances to the next slice.
  __device__ __forceinline__ void Fetch(int k0, int extent, int k_total) {
    const bool x_ok = x < extent;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      LoadGlobal4(buf[i], gptr + i * kDk, x_ok && k0 + kq + i * kDk < k_total);
    }
    gptr += BK;
  }

  // Writes the fetched slice into the stage at byte offset stage_bytes.
  __device__ __forceinline__ void Store(uint32_t stage_bytes) const {
    const uint32_t dst = sdst + stage_bytes;
#pragma unroll
    for (int i = 0; i < kCopies; ++i) {
      const float v[4] = {buf[i].x, buf[i].y, buf[i].z, buf[i].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        asm volatile("st.shared.f32 [%0], %1;\n" ::"r"(dst + 4 * (i * kDk + j) * kLds),
                     "f"(v[j]));
      }
    }
  }
};

// ---------------------------------------------------------------------------
// The register-tiled kernel.
// kAKContig = !transpose_a, kBKContig = transpose_b (see the file comment).
//
// Main loop, one K-slice s per iteration (stage (s - slice_begin) % STAGES), BK k steps
// unrolled:
//   * the A/B fragments are double-buffered in registers: step k's FFMAs use the
//     fragments loaded during step k-1, while step k+1's are read from shared memory;
//   * the cp.async copies of slice s + STAGES - 1 go to the stage slice s - 1 used
//     (freed by the barrier that ended slice s - 1), issued among the FFMAs at two
//     steps that depend on the layout (kIssueStepA/B); a register-staged operand instead
//     stores slice s + STAGES - 2 (fetched during slice s - 1) into the stage slice
//     s - 2 used, then fetches slice s + STAGES - 1 into the same registers;
//   * at the last step, before its FFMAs: wait for slice s + 1 (cp.async group),
//     barrier, read slice s + 1's first fragments; the last step's FFMAs hide that
//     latency, so the next slice starts without a shared-memory stall.
// The body has no branch: the copies (and register fetches, predicated in PTX) of
// slices past the end zero-fill and read nothing; the last iteration's extra wait, barrier and fragment reads are harmless.
// ---------------------------------------------------------------------------

// acc += a ⊗ b, one k step of a thread tile. The order of the FFMAs in the PTX steers
// ptxas's scheduling and register assignment: column by column with the rows in
// serpentine order (consecutive FFMAs share an operand across the turn) measured
// 2.5-7% faster than row by row (NN 0.963x jnp.dot at 4096^3 against 0.937x, TT 0.954x
// against 0.887x) with the same instruction count.
template <int TM, int TN>
__device__ __forceinline__ void OuterProduct(float (&acc)[TM][TN], const float* a,
                                             const float* b) {
#pragma unroll
  for (int j = 0; j < TN; ++j) {
#pragma unroll
    for (int ii = 0; ii < TM; ++ii) {
      const int i = (j & 1) ? TM - 1 - ii : ii;
      acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
}

// Copies of one operand's K-slice starting at k0, by the loader kind the kernel chose:
// a register-staged loader (kRegs) first stores the slice it fetched before into the
// stage at store_bytes (when `store`), then fetches this one into registers; a cp.async
// loader copies this one into the stage at write_bytes. ld / extent / base are the
// operand's (A: lda, M, a; B: ldb, N, b).
template <bool kRegs, class Loader>
__device__ __forceinline__ void LoadSlice(Loader& loader, uint32_t write_bytes,
                                          uint32_t store_bytes, int k0, bool store,
                                          int64_t ld, int extent, int k_total,
                                          const float* base) {
  if constexpr (kRegs) {
    if (store) loader.Store(store_bytes);
    loader.Fetch(k0, extent, k_total);
  } else {
    loader.Load(write_bytes, k0, ld, extent, k_total, base);
  }
}

template <class Cfg, bool kAKContig, bool kBKContig>
__global__ void __launch_bounds__(Cfg::kThreads, Cfg::kMinBlocks)
    SgemmTiledKernel(const GemmArgs args, const Schedule sched) {
  constexpr int BM = Cfg::BM, BN = Cfg::BN, BK = Cfg::BK;
  constexpr int WM = Cfg::WM, WN = Cfg::WN, TM = Cfg::TM, TN = Cfg::TN;
  constexpr int STAGES = Cfg::STAGES;
  constexpr int kLdsA = Cfg::kLdsA, kLdsB = Cfg::kLdsB;
  constexpr uint32_t kStageBytes = 4 * Cfg::kStageFloats;  // of A, and of B
  // Steps of a slice at which the next copies are issued (spread among the FFMAs).
  // Which steps issue them depends on the layout: chosen by measurement, since it moves
  // ptxas's schedule (128x128 on the H200, call-by-call ratios to jnp.dot HIGHEST at
  // 4096^3): NN with A at 3 (1, 2, 3 within 0.3%; 0 and 5: -3%) and B at 4 (1.014x
  // against 1.003x with B at 0; 8192^3: 1.021x against 1.008x; B at 1 or 2: -1.5%); TT
  // with A at 2 and B at 6 (0.979x against 0.954x); the other two layouts A at 0 and B
  // at BK/4 (transpose_a 0.985x against 0.969x, transpose_b 0.925x against 0.913x).
  constexpr bool kNN = kAKContig && !kBKContig, kTT = !kAKContig && kBKContig;
  constexpr int kIssueStepA = BK < 8 ? 0 : kNN ? 3 * BK / 8 : kTT ? BK / 4 : 0;
  constexpr int kIssueStepB = BK < 8 ? 0 : kNN ? BK / 2 : kTT ? 3 * BK / 4 : BK / 4;
  // K-contiguous operands go through registers (see RegSliceLoader); k-major ones
  // are copied with cp.async (see SliceLoader).
  constexpr bool kARegs = kAKContig, kBRegs = kBKContig;
  static_assert(!(kARegs || kBRegs) || STAGES >= 3,
                "a register-staged slice is stored into the stage two slices behind");
  // The slice's cp.async group closes after its last cp.async (a register-staged A
  // issues none: the group then closes with B, as measured).
  constexpr int kCommitStep =
      kARegs || kIssueStepB > kIssueStepA ? kIssueStepB : kIssueStepA;
  using ALoader = std::conditional_t<kARegs, RegSliceLoader<BK, WM, Cfg::kGroupA, kLdsA>,
                                     SliceLoader<BK, WM, Cfg::kGroupA, kLdsA>>;
  using BLoader = std::conditional_t<kBRegs, RegSliceLoader<BK, WN, Cfg::kGroupB, kLdsB>,
                                     SliceLoader<BK, WN, Cfg::kGroupB, kLdsB>>;

  extern __shared__ __align__(16) float smem[];
  float* a_smem = smem;                               // STAGES x (BK, BM + 4), padded
  float* b_smem = smem + STAGES * Cfg::kStageFloats;  // STAGES x (BK, BN + 4), padded

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int warp_row = warp % Cfg::kWarpsM;  // which WM rows of the block tile
  const int warp_col = warp / Cfg::kWarpsM;  // which WN columns of the block tile
  // Thread position in the warp tile: fragment f of A covers rows
  // f*4*kThreadsM + 4*lane_m + {0..3}; fragment f of B covers columns
  // f*4*kThreadsN + 4*lane_n + {0..3}.
  const int lane_m = lane % Cfg::kThreadsM;
  const int lane_n = lane / Cfg::kThreadsM;
  // Rank of this thread within the group that loads its warp-row / warp-column.
  const int t_in_row = warp_col * 32 + lane;
  const int t_in_col = warp_row * 32 + lane;

  // Shared byte addresses of this thread's k = 0 fragments in stage 0.
  const uint32_t a_frag_smem = SmemAddress(a_smem + warp_row * WM + 4 * lane_m);
  const uint32_t b_frag_smem = SmemAddress(b_smem + warp_col * WN + 4 * lane_n);

  // Batch entry and block tile origin of a tile (see Schedule for the numbering).
  auto locate = [&](int64_t tile, int64_t* bi, int* block_m0, int* block_n0) {
    const int tiles_n = (args.n + BN - 1) / BN;
    const int tiles_m = (args.m + BM - 1) / BM;
    const int64_t tiles_per_entry = int64_t(tiles_m) * tiles_n;
    *bi = tile / tiles_per_entry;
    int tile_n, tile_m;
    GilbertD2XY(int(tile - *bi * tiles_per_entry), tiles_n, tiles_m, &tile_n, &tile_m);
    *block_m0 = tile_m * BM;
    *block_n0 = tile_n * BN;
  };

  // One piece of work per iteration: a whole tile, or K-slices [slice_begin, slice_end)
  // of one (see Schedule).
  for (int64_t item = 0;; ++item) {
    int64_t tile;
    int slice_begin, slice_end;
    if (!WorkItem(sched, blockIdx.x, gridDim.x, item, &tile, &slice_begin, &slice_end)) break;
    int64_t bi;
    int block_m0, block_n0;
    locate(tile, &bi, &block_m0, &block_n0);
    // Batch offsets are formed here from opaque copies of the strides, so the 64-bit
    // products are not hoisted out of the work loop and held across the main loop.
    int64_t a_stride = args.a_stride, b_stride = args.b_stride;
    asm volatile("" : "+l"(a_stride), "+l"(b_stride));
    ALoader a_loader(args.a + bi * a_stride, args.lda, slice_begin * BK,
                     block_m0 + warp_row * WM, warp_row * WM, t_in_row, a_smem);
    BLoader b_loader(args.b + (bi / args.b_div) * b_stride, args.ldb, slice_begin * BK,
                     block_n0 + warp_col * WN, warp_col * WN, t_in_col, b_smem);
    // Copies of slice k0 / BK: a register-staged operand fetches it (into
    // registers) and stores the slice fetched before it into the stage at byte offset
    // store_bytes; a cp.async operand copies it into the stage at write_bytes.
    auto load_a = [&](uint32_t write_bytes, uint32_t store_bytes, int k0, bool store) {
      LoadSlice<kARegs>(a_loader, write_bytes, store_bytes, k0, store, args.lda, args.m,
                        args.k, args.a);
    };
    auto load_b = [&](uint32_t write_bytes, uint32_t store_bytes, int k0, bool store) {
      LoadSlice<kBRegs>(b_loader, write_bytes, store_bytes, k0, store, args.ldb, args.n,
                        args.k, args.b);
    };
    // One block-wide barrier (one BAR instruction, no branch). The two named
    // barriers per warp-row / warp-column it replaces took a branch tree to turn the
    // warp's barrier id into an immediate, splitting the main loop into several basic
    // blocks, and coupled 5 of the 8 warps anyway.
    auto sync_slice = [] { asm volatile("bar.sync 0;\n" ::: "memory"); };

    // Prologue: the first STAGES-1 slices in flight (slices past K are zero-filled
    // and read nothing, which keeps the group count without a branch; slices past
    // slice_end but inside K are loaded and never used).
    // A register-staged operand stores slices 0 .. STAGES-3 here and holds slice
    // STAGES-2 in registers; the first iteration stores it.
#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
      load_a(s * kStageBytes, (s - 1) * kStageBytes, (slice_begin + s) * BK, s > 0);
      load_b(s * kStageBytes, (s - 1) * kStageBytes, (slice_begin + s) * BK, s > 0);
      CpAsyncCommit();
    }

    float acc[TM][TN];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
      for (int j = 0; j < TN; ++j) acc[i][j] = 0.0f;
    }

    // Fragments of one k step, double-buffered: [k % 2].
    float4 a_frag[2][Cfg::kFragsM];
    float4 b_frag[2][Cfg::kFragsN];
    // Reads step k's fragments of the stage at byte offset stage_bytes (of A and of B).
    auto load_frags = [&](int buf, uint32_t stage_bytes, int k) {
#pragma unroll
      for (int f = 0; f < Cfg::kFragsM; ++f) {
        a_frag[buf][f] = LoadShared4(a_frag_smem + stage_bytes +
                                     4 * (k * kLdsA + f * 4 * Cfg::kThreadsM));
      }
#pragma unroll
      for (int f = 0; f < Cfg::kFragsN; ++f) {
        b_frag[buf][f] = LoadShared4(b_frag_smem + stage_bytes +
                                     4 * (k * kLdsB + f * 4 * Cfg::kThreadsN));
      }
    };

    // The first slice has landed for this thread; the barriers extend that to the
    // warps that copied the rest of this warp's rows and columns.
    CpAsyncWait<STAGES - 2>();
    sync_slice();
    load_frags(0, 0, 0);

    // Slice s uses the stage at byte offset (s * kStageBytes) & kRing, for A and for B.
    constexpr uint32_t kRing = STAGES * kStageBytes - 1;
    uint32_t ring = 0;  // (slice - slice_begin) * kStageBytes (mod 2^32)
    for (int slice = slice_begin; slice < slice_end; ++slice) {
      const uint32_t read_bytes = ring & kRing;
      const uint32_t next_bytes = (ring + kStageBytes) & kRing;
      // Stages of slices slice + STAGES - 1 (cp.async) and slice + STAGES - 2 (stores of
      // a register-staged operand).
      const uint32_t write_bytes = (ring + (STAGES - 1) * kStageBytes) & kRing;
      const uint32_t store_bytes = (ring + (STAGES - 2) * kStageBytes) & kRing;
#pragma unroll
      for (int k = 0; k < BK; ++k) {
        const int cur = k % 2;
        if (k == kIssueStepA) load_a(write_bytes, store_bytes, (slice + STAGES - 1) * BK, true);
        if (k == kIssueStepB) load_b(write_bytes, store_bytes, (slice + STAGES - 1) * BK, true);
        if (k == kCommitStep) CpAsyncCommit();
        if (k + 1 < BK) {
          load_frags(cur ^ 1, read_bytes, k + 1);
        } else {
          // Slice + 1 has landed (for the whole block after the barrier), and every
          // warp is done reading this slice's stage, which the next iteration's copies
          // overwrite.
          CpAsyncWait<STAGES - 2>();
          sync_slice();
          load_frags(cur ^ 1, next_bytes, 0);
        }
        OuterProduct<TM, TN>(acc, reinterpret_cast<const float*>(a_frag[cur]),
                             reinterpret_cast<const float*>(b_frag[cur]));
      }
      ring += kStageBytes;
    }
    // The tail's copies are still in flight; let them land before the stages are
    // reused (next piece) or the block exits.
    CpAsyncWait<0>();

    // Positions are recomputed here (from opaque reads of the thread index and of the
    // item) rather than kept live across the main loop.
    int tid;
    asm volatile("mov.u32 %0, %%tid.x;\n" : "=r"(tid));
    int64_t item_ = item;
    asm volatile("" : "+l"(item_));
    WorkItem(sched, blockIdx.x, gridDim.x, item_, &tile, &slice_begin, &slice_end);
    // Epilogue, one code path for the three kinds of piece (a second path, storing the
    // accumulators straight to the scratch buffer, changed ptxas's register assignment
    // of the main loop and cost it 3% on the H200):
    //   * a whole tile:  out = alpha * acc + beta * C;
    //   * a piece without the tile's last slice: partials[blockIdx.x] = acc (the tile's
    //     BM x BN sums, row-major), then its flag;
    //   * the tile's finisher: out = alpha * (acc + the pieces of blocks blockIdx.x - 1,
    //     - 2, ... down to the one holding the tile's first slice) + beta * C.
    // Every thread waits for and raises the flags itself: a branch on the thread index
    // here made ptxas give up the uniform registers of the main loop's stage offsets
    // (SASS), which cost it 3% on the H200.
    const bool publish = slice_end < sched.slices;
    float4* const reduced = reinterpret_cast<float4*>(smem);  // the drained ring
    bool add_pieces = false;
    static_assert(sizeof(float) * BM * BN <= Cfg::kSmemBytes,
                  "a finisher sums the pieces of its tile into the drained ring");
    if (!publish && slice_begin > 0) {
      // Sum the pieces of blocks blockIdx.x - 1, - 2, ... (down to the one holding the
      // tile's first slice) into shared memory with coalesced 16-byte loads; the
      // write-back adds that sum. kInFlight loads per thread: more (8 with 128x128, 4
      // with 128x64) raised the main loop's 4-bank register conflicts by half or
      // spilled (SASS, sm_90).
      const int64_t tile_start = tile * sched.slices;
      int64_t first = int64_t(blockIdx.x) - 1;
      WaitFlag(sched.flags + first);
      while (StreamKBegin(sched, first, gridDim.x) > tile_start) WaitFlag(sched.flags + --first);
      __syncthreads();  // every warp is done with the ring
      constexpr int kQuads = BM * BN / 4 / Cfg::kThreads;  // float4s per thread
      constexpr int kInFlight = TM * TN >= 128 ? 4 : 2;
      static_assert(kQuads % kInFlight == 0, "the tile's float4s divide into the groups");
      // (Elements outside the matrix were never published: their sums are garbage that
      // the masked write-back never reads.)
      const float4* pieces = reinterpret_cast<const float4*>(sched.partials);
      for (int q0 = 0; q0 < kQuads; q0 += kInFlight) {
        float4 sum[kInFlight];
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) sum[u] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int64_t c = first; c < blockIdx.x; ++c) {
#pragma unroll
          for (int u = 0; u < kInFlight; ++u) {
            const float4 q = __ldcg(pieces + c * (BM * BN / 4) + (q0 + u) * Cfg::kThreads + tid);
            sum[u].x += q.x;
            sum[u].y += q.y;
            sum[u].z += q.z;
            sum[u].w += q.w;
          }
        }
#pragma unroll
        for (int u = 0; u < kInFlight; ++u) reduced[(q0 + u) * Cfg::kThreads + tid] = sum[u];
      }
      __syncthreads();
      add_pieces = true;
    }
    locate(tile, &bi, &block_m0, &block_n0);
    float* const own = sched.partials + int64_t(blockIdx.x) * (BM * BN);
    const float alpha = publish ? 1.0f : args.alpha;
    const float beta = publish ? 0.0f : args.beta;
    int n_ = args.n;
    asm volatile("" : "+r"(n_));
    const int64_t mn = int64_t(args.m) * n_;
    float* out_mat = args.out + bi * mn;
    const float* c_mat = args.c + bi * mn;
    const int e_warp = tid / 32, e_lane = tid % 32;
    const int e_row0 = (e_warp % Cfg::kWarpsM) * WM + 4 * (e_lane % Cfg::kThreadsM);
    const int e_col0 = (e_warp / Cfg::kWarpsM) * WN + 4 * (e_lane / Cfg::kThreadsM);
#pragma unroll
    for (int fm = 0; fm < Cfg::kFragsM; ++fm) {
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const int row_t = e_row0 + fm * 4 * Cfg::kThreadsM + r;  // in the tile
        const int row = block_m0 + row_t;
        if (row >= args.m) continue;
        float* out_row = publish ? own + row_t * BN - block_n0 : out_mat + int64_t(row) * args.n;
        const float* c_row = c_mat + int64_t(row) * args.n;
#pragma unroll
        for (int fn = 0; fn < Cfg::kFragsN; ++fn) {
          const int col = block_n0 + e_col0 + fn * 4 * Cfg::kThreadsN;
          const float* v = &acc[4 * fm + r][4 * fn];
          const int at = row_t * BN + col - block_n0;  // in the tile, row-major
          if (args.out_vec && col < args.n) {  // n % 4 == 0, so col + 3 < n too
            float4 sum = make_float4(v[0], v[1], v[2], v[3]);
            if (add_pieces) {
              const float4 q = reduced[at / 4];
              sum.x += q.x;
              sum.y += q.y;
              sum.z += q.z;
              sum.w += q.w;
            }
            float4 o = make_float4(alpha * sum.x, alpha * sum.y, alpha * sum.z, alpha * sum.w);
            if (beta != 0.0f) {
              const float4 cv = *reinterpret_cast<const float4*>(c_row + col);
              o.x = fmaf(beta, cv.x, o.x);
              o.y = fmaf(beta, cv.y, o.y);
              o.z = fmaf(beta, cv.z, o.z);
              o.w = fmaf(beta, cv.w, o.w);
            }
            *reinterpret_cast<float4*>(out_row + col) = o;
          } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              if (col + j < args.n) {
                float sum = v[j];
                if (add_pieces) sum += reinterpret_cast<const float*>(reduced)[at + j];
                float o = alpha * sum;
                if (beta != 0.0f) o = fmaf(beta, c_row[col + j], o);
                out_row[col + j] = o;
              }
            }
          }
        }
      }
    }
    if (publish) {
      // Every thread's stores, then the flag (a release) that the finisher acquires.
      __threadfence();
      __syncthreads();
      SignalFlag(sched.flags + blockIdx.x);
    }
    // The next piece's prologue overwrites stages other warps may still read.
    __syncthreads();
  }
}

// ---------------------------------------------------------------------------
// The textbook shared-memory kernel (TILE×TILE threads, one output each),
// kept as the baseline the benchmark compares against. Correct for any shape.
// ---------------------------------------------------------------------------

template <int TILE>
__global__ void __launch_bounds__(TILE* TILE)
    SgemmTextbookKernel(const GemmArgs args, bool transpose_a, bool transpose_b) {
  __shared__ float a_tile[TILE][TILE];  // (TILE rows of M, TILE of K)
  __shared__ float b_tile[TILE][TILE];  // (TILE of K, TILE columns of N)
  const int tiles_n = (args.n + TILE - 1) / TILE;
  const int row = (blockIdx.x / tiles_n) * TILE + threadIdx.y;
  const int col = (blockIdx.x % tiles_n) * TILE + threadIdx.x;
  const int64_t mn = int64_t(args.m) * args.n;
  for (int64_t bi = blockIdx.y; bi < args.batch; bi += gridDim.y) {
    const float* a = args.a + bi * args.a_stride;
    const float* b = args.b + (bi / args.b_div) * args.b_stride;
    float sum = 0.0f;
    for (int k0 = 0; k0 < args.k; k0 += TILE) {
      const int ka = k0 + threadIdx.x;
      const int kb = k0 + threadIdx.y;
      a_tile[threadIdx.y][threadIdx.x] =
          (row < args.m && ka < args.k)
              ? a[transpose_a ? int64_t(ka) * args.lda + row : int64_t(row) * args.lda + ka]
              : 0.0f;
      b_tile[threadIdx.y][threadIdx.x] =
          (kb < args.k && col < args.n)
              ? b[transpose_b ? int64_t(col) * args.ldb + kb : int64_t(kb) * args.ldb + col]
              : 0.0f;
      __syncthreads();
#pragma unroll
      for (int k = 0; k < TILE; ++k) sum += a_tile[threadIdx.y][k] * b_tile[k][threadIdx.x];
      __syncthreads();
    }
    if (row < args.m && col < args.n) {
      const int64_t o = bi * mn + int64_t(row) * args.n + col;
      float v = args.alpha * sum;
      if (args.beta != 0.0f) v = fmaf(args.beta, args.c[o], v);
      args.out[o] = v;
    }
  }
}

// ---------------------------------------------------------------------------
// Typed launchers.
// ---------------------------------------------------------------------------

constexpr int64_t kMaxGridY = 65535;

// Each block's stream-K range is kept at least this many K-slices long, so that a
// small problem is not cut into pieces that cost more to sum than to compute.
constexpr int64_t kMinStreamKSlices = 32;

// The schedule for `tiles` tiles of `slices` K-slices each on `slots` resident blocks
// (SMs x blocks per SM); *grid receives the number of blocks to launch. Stream-K is
// used where a grid of whole tiles would leave slots idle in its last wave, and either
// fills at least one wave or at most a quarter of one: all but the last full wave stay
// whole tiles; that wave and the partial one after it are shared out by K-slices over
// every slot when each gets kMinStreamKSlices, else over fewer blocks, but only if
// they still outnumber the tiles (a split-K). Between a quarter and one wave, cutting
// every tile measured slower than leaving slots idle on the H200 (2048^3 in 128x128
// tiles: 0.950x vs 0.976x jnp.dot; 1024^3 in 128x64: 0.767x vs 0.830x), while a
// quarter wave or less gained 1.2-11x (256x256x16384, 16x8192x4096).
inline Schedule MakeSchedule(int64_t tiles, int slices, int64_t slots, bool stream_k,
                             int64_t* grid) {
  Schedule sched{};
  sched.slices = slices;
  sched.dp_tiles = tiles;
  *grid = std::min<int64_t>(tiles, INT32_MAX);
  if (!stream_k || slices == 0 || tiles % slots == 0) return sched;
  if (tiles < slots && 4 * tiles > slots) return sched;
  const int64_t waves = tiles / slots;
  const int64_t dp_tiles = waves > 1 ? (waves - 1) * slots : 0;
  const int64_t sk_slices = (tiles - dp_tiles) * slices;
  const int64_t sk_grid = std::min<int64_t>(slots, sk_slices / kMinStreamKSlices);
  if (sk_grid == slots || (dp_tiles == 0 && sk_grid > tiles)) {
    *grid = sk_grid;
    sched.dp_tiles = dp_tiles;
    sched.sk_slices = sk_slices;
  }
  return sched;
}

template <class Cfg, bool kAKContig, bool kBKContig>
cudaError_t LaunchTiled(const GemmArgs& args, bool stream_k, ffi::ScratchAllocator& scratch,
                        cudaStream_t stream) {
  auto* kernel = SgemmTiledKernel<Cfg, kAKContig, kBKContig>;
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  // Per-device launch facts, computed once: the opt-in to more than 48 KB of dynamic
  // shared memory, and how many blocks of this kernel one SM holds at a time.
  constexpr int kMaxDevices = 64;
  static std::atomic<int> resident[kMaxDevices] = {};  // SMs x blocks per SM; 0: unknown
  int slots = device < kMaxDevices ? resident[device].load(std::memory_order_relaxed) : 0;
  if (slots == 0) {
    if constexpr (Cfg::kSmemBytes > 48 * 1024) {
      if (cudaError_t err = cudaFuncSetAttribute(
              kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(Cfg::kSmemBytes));
          err != cudaSuccess) {
        return err;
      }
    }
    int sms = 0, per_sm = 0;
    if (cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
        err != cudaSuccess) {
      return err;
    }
    if (cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(
            &per_sm, kernel, Cfg::kThreads, Cfg::kSmemBytes);
        err != cudaSuccess) {
      return err;
    }
    slots = std::max(1, sms * per_sm);
    if (device < kMaxDevices) resident[device].store(slots, std::memory_order_relaxed);
  }

  const int64_t tiles_per_entry = int64_t((args.m + Cfg::BM - 1) / Cfg::BM) *
                                  ((args.n + Cfg::BN - 1) / Cfg::BN);
  if (tiles_per_entry > INT32_MAX) return cudaErrorInvalidConfiguration;  // Hilbert index
  int64_t grid = 0;
  Schedule sched = MakeSchedule(tiles_per_entry * args.batch, (args.k + Cfg::BK - 1) / Cfg::BK,
                                slots, stream_k, &grid);
  if (sched.sk_slices > 0) {
    const size_t partial_bytes = size_t(grid) * Cfg::BM * Cfg::BN * sizeof(float);
    std::optional<void*> buffer = scratch.Allocate(partial_bytes + grid * sizeof(unsigned), 16);
    if (!buffer.has_value()) {  // stream-K is only a speed-up: whole tiles instead
      return LaunchTiled<Cfg, kAKContig, kBKContig>(args, false, scratch, stream);
    }
    sched.partials = static_cast<float*>(*buffer);
    sched.flags = reinterpret_cast<unsigned*>(static_cast<char*>(*buffer) + partial_bytes);
    if (cudaError_t err = cudaMemsetAsync(sched.flags, 0, grid * sizeof(unsigned), stream);
        err != cudaSuccess) {
      return err;
    }
  }
  kernel<<<unsigned(grid), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(args, sched);
  return cudaGetLastError();
}

constexpr int kTextbookTile = 32;

cudaError_t LaunchTextbook(const GemmArgs& args, bool transpose_a, bool transpose_b,
                           cudaStream_t stream) {
  const int64_t tiles = int64_t((args.m + kTextbookTile - 1) / kTextbookTile) *
                        ((args.n + kTextbookTile - 1) / kTextbookTile);
  if (tiles > INT32_MAX) return cudaErrorInvalidConfiguration;
  const dim3 grid(unsigned(tiles), unsigned(std::min(args.batch, kMaxGridY)));
  const dim3 block(kTextbookTile, kTextbookTile);
  SgemmTextbookKernel<kTextbookTile><<<grid, block, 0, stream>>>(args, transpose_a,
                                                                 transpose_b);
  return cudaGetLastError();
}

// The compiled configurations, in the Python Config's field order:
// block_m, block_n, block_k, warp_m, warp_n, thread_m, thread_n, stages.
// pallas_gemm/matmul/cuda.py keeps the same list (a CPU test checks they agree).
using Launcher = cudaError_t (*)(const GemmArgs&, bool stream_k, ffi::ScratchAllocator&,
                                 cudaStream_t);
struct TiledEntry {
  int64_t fields[8];
  Launcher launch[2][2];  // [a K-contiguous][b K-contiguous]
};

template <class Cfg>
constexpr TiledEntry MakeEntry() {
  return {{Cfg::BM, Cfg::BN, Cfg::BK, Cfg::WM, Cfg::WN, Cfg::TM, Cfg::TN, Cfg::STAGES},
          {{LaunchTiled<Cfg, false, false>, LaunchTiled<Cfg, false, true>},
           {LaunchTiled<Cfg, true, false>, LaunchTiled<Cfg, true, true>}}};
}

// The original design's tile: 256×128 block, 8 warps of 64×64, 8×16 per thread, 4 stages;
// 128 KB shared memory (power-of-two stages), one block per SM.
using Config256x128 = TileConfig<256, 128, 8, 64, 64, 8, 16, 4, 1>;
// The same warp and thread tiles in a 128×128 block: 4 warps of 64×64, 8×16 per
// thread, two blocks per SM. Two independent blocks whose barriers each hold 4 warps
// instead of one whose barrier holds 8: on the H200 it beat 256×128 by 5-16% (NN, NT)
// at 2048^3 and 4096^3 and lost 4% on TT.
using Config128x128 = TileConfig<128, 128, 8, 64, 64, 8, 16, 4, 2>;
// Smaller still: 4 warps of 64×32, 8×8 per thread, three blocks per SM (at four, the
// 128-register cap spills).
using Config128x64 = TileConfig<128, 64, 8, 64, 32, 8, 8, 4, 3>;

const TiledEntry kTiledEntries[] = {
    MakeEntry<Config256x128>(),
    MakeEntry<Config128x128>(),
    MakeEntry<Config128x64>(),
};
constexpr int kNumTiled = sizeof(kTiledEntries) / sizeof(kTiledEntries[0]);
// The textbook kernel in the same vocabulary: a 32×32 block tile, K-slices of 32,
// warps of 1×32, one output per thread, no pipeline.
constexpr int64_t kTextbookFields[8] = {32, 32, 32, 1, 32, 1, 1, 1};

// ---------------------------------------------------------------------------
// FFI handler.
// ---------------------------------------------------------------------------

std::string DimsToString(ffi::Span<const int64_t> dims) {
  std::string s = "(";
  for (size_t i = 0; i < dims.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(dims[i]);
  }
  return s + (dims.size() == 1 ? ",)" : ")");
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

ffi::Error SgemmImpl(cudaStream_t stream, ffi::ScratchAllocator scratch, ffi::Buffer<ffi::F32> a,
                     ffi::Buffer<ffi::F32> b, ffi::Buffer<ffi::F32> c,
                     ffi::ResultBuffer<ffi::F32> out, float alpha, float beta,
                     bool transpose_a, bool transpose_b, int64_t block_m,
                     int64_t block_n, int64_t block_k, int64_t warp_m, int64_t warp_n,
                     int64_t thread_m, int64_t thread_n, int64_t stages, bool stream_k) {
  const auto a_dims = a.dimensions();
  const auto b_dims = b.dimensions();
  const auto out_dims = out->dimensions();
  const size_t rank = out_dims.size();
  if (rank < 2 || a_dims.size() != rank || (b_dims.size() != rank && b_dims.size() != 2)) {
    return ffi::Error::InvalidArgument(
        "pallas_gemm_cuda_sgemm: expected a, b and out of one rank >= 2 (b may be 2-D), got a" +
        DimsToString(a_dims) + ", b" + DimsToString(b_dims) + ", out" + DimsToString(out_dims));
  }
  // An operand's stored rows may be longer than the matrix along M (transposed A) or
  // N (B): cuda.py pads them to 16 bytes for the vector path; the kernel reads only
  // the first m / n entries of each row. K is never padded on one side only.
  const int64_t m = out_dims[rank - 2], n = out_dims[rank - 1];
  const int64_t k = transpose_a ? a_dims[rank - 2] : a_dims[rank - 1];
  const int64_t a_m = transpose_a ? a_dims[rank - 1] : a_dims[rank - 2];
  const size_t rb = b_dims.size();
  const int64_t b_k = transpose_b ? b_dims[rb - 1] : b_dims[rb - 2];
  const int64_t b_n = transpose_b ? b_dims[rb - 2] : b_dims[rb - 1];
  if ((transpose_a ? a_m < m : a_m != m) || b_k != k || (transpose_b ? b_n != n : b_n < n)) {
    return ffi::Error::InvalidArgument(
        "pallas_gemm_cuda_sgemm: shapes do not multiply: a" + DimsToString(a_dims) +
        (transpose_a ? " (transposed)" : "") + ", b" + DimsToString(b_dims) +
        (transpose_b ? " (transposed)" : "") + ", out" + DimsToString(out_dims));
  }
  // Leading dims are batch dims. Those of a must equal out's; those of b must be a
  // prefix of them followed by 1s (e.g. (V, batch) vs (V, 1) under vmap), so that
  // output entry i uses B entry i / b_div.
  int64_t batch = 1;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (a_dims[i] != out_dims[i]) {
      return ffi::Error::InvalidArgument("pallas_gemm_cuda_sgemm: batch dims of a" +
                                         DimsToString(a_dims) + " differ from out" +
                                         DimsToString(out_dims));
    }
    batch *= out_dims[i];
  }
  int64_t b_div = batch;
  if (rb == rank) {
    size_t p = 0;
    while (p + 2 < rank && b_dims[p] == out_dims[p]) ++p;
    b_div = 1;
    for (size_t i = p; i + 2 < rank; ++i) {
      if (b_dims[i] != 1) {
        return ffi::Error::InvalidArgument(
            "pallas_gemm_cuda_sgemm: batch dims of b" + DimsToString(b_dims) +
            " are neither out's" + DimsToString(out_dims) + " nor a prefix of them then 1s");
      }
      b_div *= out_dims[i];
    }
  }
  if (beta != 0.0f && c.element_count() != out->element_count()) {
    return ffi::Error::InvalidArgument("pallas_gemm_cuda_sgemm: beta != 0 needs c shaped like out" +
                                       DimsToString(out_dims) + ", got c" +
                                       DimsToString(c.dimensions()));
  }
  constexpr int64_t kMaxDim = INT32_MAX - 256;  // block origins + offsets stay in int32
  if (m > kMaxDim || n > kMaxDim || k > kMaxDim) {
    return ffi::Error::InvalidArgument("pallas_gemm_cuda_sgemm: M, N and K must be below 2^31 - 256, got out" +
                                       DimsToString(out_dims) + " with K = " + std::to_string(k));
  }
  if (out->element_count() == 0) return ffi::Error::Success();

  GemmArgs args;
  args.a = a.typed_data();
  args.b = b.typed_data();
  args.c = c.typed_data();
  args.out = out->typed_data();
  args.m = int(m);
  args.n = int(n);
  args.k = int(k);
  args.lda = a_dims[rank - 1];
  args.ldb = b_dims[rb - 1];
  args.a_stride = a_dims[rank - 2] * a_dims[rank - 1];
  args.b_stride = b_dims[rb - 2] * b_dims[rb - 1];
  args.batch = batch;
  args.b_div = b_div;
  args.alpha = alpha;
  args.beta = beta;
  args.out_vec = n % 4 == 0 && Aligned16(args.out) && (beta == 0.0f || Aligned16(args.c));

  const int64_t fields[8] = {block_m, block_n, block_k, warp_m, warp_n,
                             thread_m, thread_n, stages};
  cudaError_t err = cudaErrorInvalidValue;
  bool found = false;
  if (std::equal(fields, fields + 8, kTextbookFields)) {
    found = true;
    err = LaunchTextbook(args, transpose_a, transpose_b, stream);
  }
  for (int i = 0; i < kNumTiled && !found; ++i) {
    if (std::equal(fields, fields + 8, kTiledEntries[i].fields)) {
      found = true;
      // 16-byte copies and loads of every stored row (cuda.py pads rows to make it so).
      if (args.lda % 4 || args.ldb % 4 || !Aligned16(args.a) || !Aligned16(args.b)) {
        return ffi::Error::InvalidArgument(
            "pallas_gemm_cuda_sgemm: the tiled kernels need 16-byte aligned rows (a multiple "
            "of 4 floats) and base pointers; got rows of " + std::to_string(args.lda) +
            " (a) and " + std::to_string(args.ldb) + " (b) floats");
      }
      err = kTiledEntries[i].launch[!transpose_a][transpose_b](args, stream_k, scratch, stream);
    }
  }
  if (!found) {
    return ffi::Error::InvalidArgument(
        "pallas_gemm_cuda_sgemm: no kernel compiled for block (" + std::to_string(block_m) +
        ", " + std::to_string(block_n) + ", " + std::to_string(block_k) + "), warp (" +
        std::to_string(warp_m) + ", " + std::to_string(warp_n) + "), thread (" +
        std::to_string(thread_m) + ", " + std::to_string(thread_n) +
        "), stages " + std::to_string(stages));
  }
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("pallas_gemm_cuda_sgemm: CUDA error: ") +
                                cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

}  // namespace pallas_gemm

// Declared first so the symbol is exported despite -fvisibility=hidden.
PALLAS_GEMM_EXPORT XLA_FFI_Error* PallasGemmCudaSgemm(XLA_FFI_CallFrame* call_frame);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    PallasGemmCudaSgemm, pallas_gemm::SgemmImpl,
    ffi::Ffi::Bind()
        .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream the computation runs on
        .Ctx<ffi::ScratchAllocator>()              // stream-K partial sums and flags
        .Arg<ffi::Buffer<ffi::F32>>()              // a: (..., M, K), or (..., K, M) when transpose_a
        .Arg<ffi::Buffer<ffi::F32>>()              // b: (..., K, N), or (..., N, K) when transpose_b
        .Arg<ffi::Buffer<ffi::F32>>()              // c: (..., M, N); any placeholder when beta == 0
        .Ret<ffi::Buffer<ffi::F32>>()              // out: (..., M, N)
        .Attr<float>("alpha")                      // scales op(a) @ op(b)
        .Attr<float>("beta")                       // scales c; 0 means c is not read
        .Attr<bool>("transpose_a")                 // a holds op(a) transposed
        .Attr<bool>("transpose_b")                 // b holds op(b) transposed
        .Attr<int64_t>("block_m")                  // block tile rows (BM)
        .Attr<int64_t>("block_n")                  // block tile columns (BN)
        .Attr<int64_t>("block_k")                  // K-slice depth (BK)
        .Attr<int64_t>("warp_m")                   // warp tile rows (WM)
        .Attr<int64_t>("warp_n")                   // warp tile columns (WN)
        .Attr<int64_t>("thread_m")                 // thread tile rows (TM)
        .Attr<int64_t>("thread_n")                 // thread tile columns (TN)
        .Attr<int64_t>("stages")                   // cp.async pipeline depth (STAGES)
        .Attr<bool>("stream_k"));                  // share the last waves out by K-slices

// ---------------------------------------------------------------------------
// Host helpers for the Python twin and its CPU tests (ctypes).
// ---------------------------------------------------------------------------

PALLAS_GEMM_EXPORT int pallas_gemm_cuda_num_configs() { return pallas_gemm::kNumTiled + 1; }

// Writes the 8 fields of compiled configuration i (the last one is the textbook kernel).
// Returns 0, or -1 when i is out of range.
PALLAS_GEMM_EXPORT int pallas_gemm_cuda_config(int i, int64_t* fields) {
  if (i < 0 || i > pallas_gemm::kNumTiled) return -1;
  const int64_t* src = i < pallas_gemm::kNumTiled ? pallas_gemm::kTiledEntries[i].fields
                                                  : pallas_gemm::kTextbookFields;
  std::copy(src, src + 8, fields);
  return 0;
}

// The tile (row, col) that block idx of a rows×cols tile grid computes; the same
// function the kernel runs. Returns 0, or -1 when the arguments are out of range.
PALLAS_GEMM_EXPORT int pallas_gemm_cuda_hilbert(int64_t idx, int64_t rows, int64_t cols,
                                                int64_t* row, int64_t* col) {
  if (rows < 1 || cols < 1 || rows * cols > INT32_MAX || idx < 0 || idx >= rows * cols) {
    return -1;
  }
  int x = 0, y = 0;
  pallas_gemm::GilbertD2XY(int(idx), int(cols), int(rows), &x, &y);
  *row = y;
  *col = x;
  return 0;
}

// The launch schedule for the CPU tests: fields = {dp_tiles, sk_slices, grid}.
PALLAS_GEMM_EXPORT void pallas_gemm_cuda_schedule(int64_t tiles, int64_t slices, int64_t slots,
                                                  int stream_k, int64_t* fields) {
  int64_t grid = 0;
  const pallas_gemm::Schedule s =
      pallas_gemm::MakeSchedule(tiles, int(slices), slots, stream_k != 0, &grid);
  fields[0] = s.dp_tiles;
  fields[1] = s.sk_slices;
  fields[2] = grid;
}

// Piece `item` of block `block` (the kernel's own code): piece = {tile, slice_begin,
// slice_end}; returns 0 past the block's last piece, else 1. *range_begin receives
// the block's first stream-K slice (absolute), which the finisher's wait loop uses.
PALLAS_GEMM_EXPORT int pallas_gemm_cuda_work_item(int64_t dp_tiles, int64_t sk_slices,
                                                  int64_t slices, int64_t block, int64_t grid,
                                                  int64_t item, int64_t* piece,
                                                  int64_t* range_begin) {
  pallas_gemm::Schedule s{};
  s.dp_tiles = dp_tiles;
  s.sk_slices = sk_slices;
  s.slices = int(slices);
  *range_begin = pallas_gemm::StreamKBegin(s, block, grid);
  int64_t tile = 0;
  int begin = 0, end = 0;
  if (!pallas_gemm::WorkItem(s, block, grid, item, &tile, &begin, &end)) return 0;
  piece[0] = tile;
  piece[1] = begin;
  piece[2] = end;
  return 1;
}
