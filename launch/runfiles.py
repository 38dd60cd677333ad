"""Reading the model files and consensus traces a run's processes left behind, trusting none of them.

A peer writes ``model-<rank>.pt`` and ``trace-<rank>.npz`` when it finishes, the parameter server
``model-final.pt``; the summary (``launch/summary.py``) reads them back. Any of them may be missing, cut
short, damaged on a copy between hosts, or hold what the peer was fooled into (rounds far beyond the run).
Each reader returns the file's content in a form the summary can compute with without another check, or
None and one phrase that names the file and what is wrong with it; none raises for what a file holds.

- A model must load with ``torch.load(weights_only=True)`` (no code runs) and hold exactly the task's
  entries, each a dense tensor of the task model's shape and dtype; a file more than twice the model's
  size (plus 1 MiB) is not read at all.
- A trace must be an ``.npz`` archive (no pickles) of ``rounds`` (counts), ``values`` (floats, a row per
  round), ``weights`` (push-sum weights > 0, one per round) and ``index`` (the sampled coordinates, one
  per column, each below the model's size), each array at most ``MAX_TRACE_ARRAY_BYTES`` (a peer writes
  at most 16 MB of values, ``gossip/peer.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

MAX_TRACE_ARRAY_BYTES = 64 << 20
TRACE_ARRAYS = ("rounds", "values", "weights", "index")


def first_line(exc: BaseException, limit: int = 120) -> str:
    """An exception as one short line: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"


def load_model(path: Path, reference: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor] | None, str | None]:
    """(the model state in ``path``, None), or (None, what is wrong with the file); ``reference``: the task
    model's ``state_dict()``, whose entries, shapes and dtypes the file must have."""
    name = path.name
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return None, f"{name} is missing"
    except OSError as exc:
        return None, f"{name} cannot be read ({exc.strerror})"
    limit = 2 * sum(t.numel() * t.element_size() for t in reference.values()) + (1 << 20)
    if size > limit:
        return None, f"{name} holds {size} bytes, more than a model of this task can ({limit} at most)"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - whatever torch's reader raises on bytes it cannot read
        return None, f"{name} does not load ({first_line(exc)})"
    if not isinstance(state, dict):
        return None, f"{name} holds {_describe(state)}, not a model's state"
    missing = [key for key in reference if key not in state]
    extra = [key for key in state if key not in reference]
    if missing or extra:
        which = f"lacks {missing[0]!r}" if missing else f"has an entry {str(extra[0])[:40]!r}"
        return None, f"{name} {which}, unlike the task's model"
    for key, expected in reference.items():
        tensor = state[key]
        if (not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided or tensor.shape != expected.shape
                or tensor.dtype != expected.dtype):
            return None, f"{name}'s {key!r} is {_describe(tensor)}; the task's model has {_describe(expected)}"
    return {key: state[key] for key in reference}, None


@dataclass
class Trace:
    """One peer's sampled weights per round (``gossip/peer.py``'s ``Trace``), checked."""

    rounds: np.ndarray  # int64, one per row
    values: np.ndarray  # float64, rounds x coordinates
    weights: np.ndarray  # float64 > 0, one per row
    index: np.ndarray  # int64, the sampled coordinates


def load_trace(path: Path, numel: int) -> tuple[Trace | None, str | None]:
    """(the trace in ``path``, None), or (None, what is wrong with the file); ``numel``: the model's size,
    above which no sampled coordinate lies."""
    name = path.name
    try:
        data = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        return None, f"{name} is missing"
    except Exception as exc:  # noqa: BLE001 - whatever numpy's reader raises on bytes it cannot read
        return None, f"{name} does not load ({first_line(exc)})"
    if not isinstance(data, np.lib.npyio.NpzFile):
        return None, f"{name} is not an .npz archive"
    arrays = {}
    try:
        with data:
            for key in TRACE_ARRAYS:
                if f"{key}.npy" not in data.zip.namelist():
                    return None, f"{name} has no {key!r} array"
                size = data.zip.getinfo(f"{key}.npy").file_size
                if size > MAX_TRACE_ARRAY_BYTES:
                    return None, f"{name}'s {key!r} holds {size} bytes, more than a peer writes"
                arrays[key] = data[key]
    except Exception as exc:  # noqa: BLE001 - a damaged member, a pickle: numpy and zipfile raise many kinds
        return None, f"{name} does not load ({first_line(exc)})"
    problem = _trace_problem(arrays, numel)
    if problem:
        return None, f"{name} {problem}"
    return Trace(arrays["rounds"].astype(np.int64), arrays["values"].astype(np.float64),
                 arrays["weights"].astype(np.float64), arrays["index"].astype(np.int64)), None


def _trace_problem(arrays: dict[str, np.ndarray], numel: int) -> str | None:
    rounds, values, weights, index = (arrays[key] for key in TRACE_ARRAYS)
    integer = [key for key in ("rounds", "index") if not np.issubdtype(arrays[key].dtype, np.integer)]
    real = [key for key in ("values", "weights") if not (np.issubdtype(arrays[key].dtype, np.floating)
                                                         or np.issubdtype(arrays[key].dtype, np.integer))]
    if integer or real:
        key = (integer + real)[0]
        return f"holds {key!r} of dtype {arrays[key].dtype}, not {'integers' if integer else 'numbers'}"
    if rounds.ndim != 1 or weights.ndim != 1 or index.ndim != 1 or values.ndim != 2:
        return (f"holds arrays of the wrong shapes (rounds {list(rounds.shape)}, values {list(values.shape)}, "
                f"weights {list(weights.shape)}, index {list(index.shape)})")
    if not len(rounds):
        return "holds no round"
    if values.shape != (len(rounds), len(index)) or len(weights) != len(rounds) or not len(index):
        return (f"holds arrays that do not fit together (rounds {len(rounds)}, values {list(values.shape)}, "
                f"weights {len(weights)}, index {len(index)})")
    if rounds.min() < 0 or rounds.max() > np.iinfo(np.int64).max:
        return f"names round {rounds.min() if rounds.min() < 0 else rounds.max()}"
    if index.min() < 0 or index.max() >= numel:
        return f"samples coordinate {index.max() if index.max() >= numel else index.min()}; the model has {numel}"
    if not (np.all(np.isfinite(weights)) and np.all(weights > 0)):
        return "holds a push-sum weight that is not a finite number > 0"
    return None
