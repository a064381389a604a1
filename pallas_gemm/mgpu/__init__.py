"""The Mosaic GPU layer every family's Hopper kernels are built from, under public names
and with nothing of any one family: hardware facts (`hw`), TMA layout and padding
(`layout`, `unpad`), the persistent warp-specialized launch (`launch`), the producer ring
(`ring`), tile-config checks (`tiles`), row-masked stores (`rows`) and the promoted fp8 K
loop (`scaled_k`). Imports only `core`."""
