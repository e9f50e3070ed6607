r"""Which parameters Muon orthogonalises and which AdamW updates, decided by rule from names and shapes.

The rule (docs/optimizer.md): a trainable tensor goes to Muon when it is a matrix of a
hidden layer, i.e. it has two or more dimensions, both matrix sides are larger than one,
and its name matches none of the exclude patterns; everything else goes to AdamW.
`exclude` patterns (config) add to the default excludes below; `include` patterns force a
tensor to Muon over every exclude.

How a tensor is seen as matrices (`matrix_view`):
- 2-D `[A, B]`: one matrix (a Linear weight, out x in).
- 3-D `[E, A, B]`: a stack of E matrices (one per expert or per q/k/v), each
  orthogonalised on its own with the lr adjustment of `[A, B]`.
- 4-D and more (conv kernels): flattened to `[shape[0], prod(rest)]`.

Default excludes, and why: input embeddings and embedders (token, patch, time and text
embedders: `patch_embedding` is Wan's input Conv3d, i.e. the first layer, which Muon
leaves to AdamW), output heads and decoders (`proj_out`, `head`, the action decoder),
norms, AdaLN modulation (the `modulation` / `scale_shift_table` tables, and `time_proj`,
the projection of the time embedding that produces them: Wan's sits under
`condition_embedder`, the action expert's is its own), learned registers, and position
tables. The state/action encoders' MLPs are hidden layers by this rule (to send their first
layer to AdamW, set `training.muon.exclude: ['_encoder\.0\.']`).
"""
import re
from typing import Any, Iterable, Sequence

PRESETS = ("all_hidden", "action_expert_only")

DEFAULT_EXCLUDE = (
    r"embed",                                   # embeddings and embedders (incl. patch_embedding)
    r"(^|\.)(lm_head|head|heads|proj_out|decoder|output_proj)(\.|$)",  # output heads / decoders
    r"norm",                                    # norm weights (RMSNorm, LayerNorm, norm_q/k)
    r"modulation|scale_shift|time_proj",        # AdaLN: modulation/scale-shift tables, the time projection
    r"register",                                # learned register tokens
    r"pos_emb|position|rope",                   # position tables
)

# OpenDM's rule: only the action expert's per-layer weight matrices.
ACTION_EXPERT_ONLY = r"action_expert.*\.(blocks|layers)\..*\.weight$"


def matrix_view(shape: Sequence[int]) -> tuple[int, int, int]:
    """(count, A, B): how a tensor of `shape` is orthogonalised (see the module docstring)."""
    if len(shape) == 2:
        return 1, shape[0], shape[1]
    if len(shape) == 3:
        return shape[0], shape[1], shape[2]
    rest = 1
    for s in shape[1:]:
        rest *= s
    return 1, shape[0], rest


def _compile(patterns: Iterable[str], what: str) -> list[re.Pattern[str]]:
    out = []
    for p in patterns:
        try:
            out.append(re.compile(p))
        except re.error as e:
            raise ValueError(f"training.muon.{what}: pattern {p!r} is not a valid regex: {e}") from None
    return out


def split_params(named_parameters: Iterable[tuple[str, Any]], routing: str = "all_hidden",
                 include: Sequence[str] | None = None, exclude: Sequence[str] | None = None
                 ) -> tuple[list[tuple[str, Any]], list[tuple[str, Any]]]:
    """Split trainable (name, param) pairs into (muon, adamw) lists, each in model order."""
    if routing not in PRESETS:
        raise ValueError(f"training.muon.routing is {routing!r}; expected one of {', '.join(PRESETS)}")
    inc = _compile(include or (), "include")
    exc = _compile(DEFAULT_EXCLUDE + tuple(exclude or ()), "exclude")
    preset = re.compile(ACTION_EXPERT_ONLY) if routing == "action_expert_only" else None
    muon: list = []
    adamw: list = []
    seen = set()
    for name, p in named_parameters:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        is_matrix = p.ndim >= 2 and min(matrix_view(p.shape)[1:]) > 1
        forced = any(r.search(name) for r in inc)
        if forced and not is_matrix:
            raise ValueError(f"training.muon.include matches '{name}' of shape {tuple(p.shape)}, which is "
                             "not a matrix (Muon needs >= 2 dims with both sides > 1); narrow the pattern")
        chosen = forced or (is_matrix and not any(r.search(name) for r in exc)
                            and (preset is None or preset.search(name) is not None))
        (muon if chosen else adamw).append((name, p))
    return muon, adamw
