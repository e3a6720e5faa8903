"""Stage 3, the tile IR: which tiles of each weight stay dense, which are 2:4, and their packed buffers.

It receives hard masks from hardening (`patchc.masking.harden`), one-shot masks (`patchc.pruning`) or
already-pruned weights, and hands `TilePlan`s to codegen (`patchc.codegen.pack`), the runtime and the
report. Its vocabulary (2:4 pattern codes, tile geometry) is shared by every stage.

    patterns.py     the 6 2:4 patterns, group codes, nibble metadata packing
    tiles.py        tile kinds, the padded grid, tiling / untiling
    compress.py     W * M -> dense tiles + 2:4 values + metadata (LayerPlan.from_mask)
    verify.py       every check a layer's buffers must pass
    layer_plan.py   LayerPlan: one weight
    layer_slot.py   LayerSlot: a weight's buffer shapes from its tile kinds, before it is packed
    tile_plan.py    TilePlan: a model's weights, apply, summary
    from_pruned.py  plans from pruned weights or from masks; survey_linears: slots first, packing later
    slicing.py      a plan's block of whole tiles, plans stacked row-wise (flat experts cut per expert)
    file_format.py  the safetensors file and its versioned header

A `LayerPlan` describes one linear weight W of shape (N, K) = (out_features, in_features), cut into
b1 x b2 tiles (b1 rows along N, b2 columns along K). The grid is (Tn, Tk) = (ceil(N/b1), ceil(K/b2));
edge tiles are partial and stored zero padded to the full b1 x b2 ("padded grid"). Each tile is
TILE_DENSE (all its weights kept) or TILE_SPARSE24 (exactly 2 of every 4 consecutive weights along K
kept). A `TilePlan` maps weight FQNs to `LayerPlan`s, lists the layers it skipped (and why), and
carries free-form JSON metadata (config, schedule, ...).

Tile grid of a (40, 24) weight with tile (16, 16): grid 3 x 2, `kinds` row-major; `D` dense, `S` 2:4::

              K ->  cols 0..15   16..23 (+8 padding)
    N  rows  0..15  [   D    ]  [  S  :pad ]     dense  = tiles (0,0), (1,1), (2,0)      (row-major)
    |  rows 16..31  [   S    ]  [  D  :pad ]     sparse = tiles (0,1), (1,0), (2,1)
    v  rows 32..39  [   D    ]  [  S  :pad ]     dense_rowptr  = [0, 1, 2, 3], dense_cols  = [0, 1, 0]
          (+8 pad)  [  pad   ]  [ pad :pad ]     sparse_rowptr = [0, 1, 2, 3], sparse_cols = [1, 0, 1]

One tile row of a 2:4 tile with b2 = 8 (two groups of 4): group 0 keeps positions (1, 3), group 1
keeps (0, 1). The kept values go to `values` in increasing position order; each group's positions
become a nibble i0 | (i1 << 2); byte j of a tile row holds group 2j (low nibble) and 2j+1 (high)::

    W row        [ 0  a  0  b | c  d  0  0 ]
    values row   [ a  b  c  d ]                      (b2 / 2 values per tile row)
    nibbles      g0 = 1 | 3 << 2 = 0b1101 = 0xD      g1 = 0 | 1 << 2 = 0b0100 = 0x4
    meta row     [ 0x4D ]                            (ceil(b2 / 8) bytes; for b2 % 8 == 4 the last
                                                      byte's high nibble is 0)

The 6 candidate patterns, in this order everywhere (`PATTERNS`, index p <-> positions (i0, i1)):
1100 (0,1), 1010 (0,2), 1001 (0,3), 0110 (1,2), 0101 (1,3), 0011 (2,3).

Buffers (all tensors in row-major grid order; the i-th dense tile is the i-th `TILE_DENSE` entry of
`kinds.flatten()`, which is also the i-th tile in CSR order `dense_rowptr`/`dense_cols`):

    kinds  uint8 (Tn, Tk)              dense  dtype (n_dense, b1, b2)
    values dtype (n_sparse, b1, b2/2)  meta   uint8 (n_sparse, b1, ceil(b2/8))   bias dtype (N,) or None

Stored as one safetensors file: tensors "<fqn>::kinds|dense|values|meta|bias" and metadata
{"patchc": JSON header} (format "patchc.tileplan", version 2 with checksums; `file_format.py`). Loading never unpickles anything.

Example:
    >>> import torch
    >>> w = torch.randn(40, 24)
    >>> kinds = torch.tensor([[0, 1], [1, 0], [0, 1]], dtype=torch.uint8)
    >>> mask = torch.ones(40, 24, dtype=torch.bool)
    >>> mask[16:32, :16] = PATTERNS[1].repeat(16, 4)          # tile (1, 0): keep positions 0, 2
    >>> mask[:16, 16:] = mask[32:, 16:] = PATTERNS[0].repeat(1, 2)  # tiles (0, 1), (2, 1): keep 0, 1
    >>> layer = LayerPlan.from_mask("fc.weight", w, kinds, mask, tile=(16, 16))
    >>> torch.equal(layer.to_dense(), w * mask), layer.n_dense, layer.n_sparse
    (True, 3, 3)
    >>> plan = TilePlan(layers={"fc.weight": layer}, skipped={"head.weight": "excluded"})
    >>> plan.save("/tmp/fc.patch"); TilePlan.load("/tmp/fc.patch").density == plan.density
    True
"""

from patchc.ir.errors import PlanError
from patchc.ir.file_format import FORMAT, VERSION
from patchc.ir.layer_plan import LayerPlan
from patchc.ir.patterns import (
    PATTERNS,
    group_codes,
    pack_meta,
    pack_nibbles,
    pattern_index,
    pattern_to_positions,
    unpack_meta,
    unpack_nibbles,
)
from patchc.ir.tile_plan import TilePlan
from patchc.ir.tiles import (
    KIND_NAMES,
    TILE_DENSE,
    TILE_SPARSE24,
    expand_tiles,
    from_tiles,
    tile_grid,
    tile_sizes,
    to_tiles,
)

__all__ = [
    "TilePlan",
    "LayerPlan",
    "PlanError",
    "FORMAT",
    "VERSION",
    "TILE_DENSE",
    "TILE_SPARSE24",
    "KIND_NAMES",
    "PATTERNS",
    "group_codes",
    "pattern_index",
    "pattern_to_positions",
    "pack_meta",
    "unpack_meta",
    "pack_nibbles",
    "unpack_nibbles",
    "tile_grid",
    "tile_sizes",
    "expand_tiles",
    "to_tiles",
    "from_tiles",
]
