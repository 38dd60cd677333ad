"""Checkpoints that a crash never leaves half-written, that are checked before they are written and after
they are read, and that keep the previous good one beside the newest.

``write`` writes to a temporary file beside the target, flushes and fsyncs it, renames the current
checkpoint to ``<name>.prev.pt``, renames the temporary file to the target and fsyncs the directory: at
every instant the target is the newest complete checkpoint, or (for the instant between the two renames,
or after a crash there) absent with the previous complete one in ``.prev.pt``. A failed write (a full
disk, say) leaves both in place, removes the temporary file and reports ``CheckpointError``; the caller
decides whether to go on. ``save`` first refuses a state that ``refusal`` finds unfit (a NaN or Inf
anywhere, a counter missing or out of range), so a diverging model is never saved over a good checkpoint.

``load`` reads with ``weights_only=True``: a checkpoint holds tensors and plain values, never code.
``restore`` takes the newest of the target and its ``.prev.pt`` that reads and passes the caller's
check (``validate``/``fit_problem``: every expected key, counters of the right type and range, every
tensor finite, the model's keys, shapes and dtypes, the optimizer's groups and state shapes), before
anything is loaded into a model. A bad newest one beside a good previous one is renamed to
``<name>.bad.pt`` (kept to look at), so that the next ``write`` does not rotate it over the good one.

What is refused before writing and what is refused after reading are one
contract, kept in one file so that the two cannot drift apart.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from gossip.errors import CheckpointError

# Kinds of counter (``refusal``/``fit_problem``'s ``counters``: dotted key -> kind)
COUNT = "count"  # an int >= 0 (not a bool)
NUMBER = "number"  # a finite int or float >= 0
POSITIVE = "positive"  # a finite int or float > 0
COUNTS = "counts"  # a list of counts
COUNT_MAP = "count-map"  # a dict count -> count
_KINDS = {COUNT: "a non-negative integer", NUMBER: "a finite number >= 0", POSITIVE: "a finite number > 0",
          COUNTS: "a list of non-negative integers", COUNT_MAP: "a dict of non-negative integers"}


def previous_path(path: str | Path) -> Path:
    """``checkpoint-3.pt`` -> ``checkpoint-3.prev.pt``: the good checkpoint before the newest."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def set_aside_path(path: str | Path) -> Path:
    """``checkpoint-3.pt`` -> ``checkpoint-3.bad.pt``: a newest checkpoint ``restore`` found unusable."""
    path = Path(path)
    return path.with_name(f"{path.stem}.bad{path.suffix}")


def save(state: dict[str, Any], path: str | Path, counters: Mapping[str, str] | None = None) -> None:
    """``write`` ``state`` unless ``refusal`` finds it unfit; then raise ``CheckpointError`` and write nothing."""
    reason = refusal(state, counters or {})
    if reason is not None:
        raise CheckpointError(f"checkpoint {path} not written: {reason}; the previous one is kept")
    write(state, path)


def write(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` atomically, the current checkpoint becoming ``.prev.pt`` (module docstring)."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        if path.exists():
            os.replace(path, previous_path(path))
        os.replace(temporary, path)
        _fsync_directory(path.parent)
    except (OSError, RuntimeError) as exc:  # torch's zip writer reports a full disk as RuntimeError
        temporary.unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"checkpoint {path} not written ({reason}); the previous one is kept") from exc


def load(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        return torch.load(path, weights_only=True)
    except Exception as exc:  # a damaged file can fail in any of torch's or pickle's ways: translate them all
        raise CheckpointError(f"cannot read checkpoint {path}: {_read_error(exc)}") from exc


def restore(path: str | Path, check: Callable[[Any, Path], Any]
            ) -> tuple[dict[str, Any] | None, Path | None, list[str]]:
    """The newest usable of ``path`` and ``previous_path(path)``: (state, its file, one line for each file
    that exists but does not read or that ``check(state, file)`` rejects by raising ``CheckpointError``).
    (None, None, [...]) when neither is usable (the list is empty when neither exists). A rejected ``path``
    is renamed to ``set_aside_path`` when the previous one is used."""
    path = Path(path)
    rejected: list[str] = []
    for candidate in (path, previous_path(path)):
        if not candidate.exists():
            continue
        try:
            state = load(candidate)
            check(state, candidate)
        except CheckpointError as exc:
            rejected.append(str(exc))
            continue
        except Exception as exc:  # a hostile structure (nested too deep, say) must not end in a traceback
            rejected.append(str(unusable(candidate, f"it cannot be checked ({type(exc).__name__}: "
                                                    f"{_first_line(exc)})")))
            continue
        if candidate != path and path.exists():
            try:
                os.replace(path, set_aside_path(path))
                rejected[0] += f" (renamed to {set_aside_path(path).name})"
            except OSError:
                pass
        return state, candidate, rejected
    return None, None, rejected


def unusable(path: str | Path, problem: str) -> CheckpointError:
    """The error for a checkpoint that reads but cannot be used, naming the file and the problem."""
    return CheckpointError(f"checkpoint {path} is unusable: {problem}")


def validate(state: Any, path: str | Path, **expected: Any) -> dict[str, Any]:
    """``state`` when ``fit_problem(state, **expected)`` finds nothing wrong, else ``CheckpointError``."""
    problem = fit_problem(state, **expected)
    if problem is not None:
        raise unusable(path, problem)
    return state


def refusal(state: Any, counters: Mapping[str, str]) -> str | None:
    """Why ``state`` must not be written (a counter missing or of the wrong type or range, a NaN or Inf in
    any tensor or float), or None."""
    return _counter_problem(state, counters, {}) or value_problem(state, "")


def fit_problem(state: Any, *, keys: Iterable[str], counters: Mapping[str, str],
                bounds: Mapping[str, float] | None = None, model: Mapping[str, torch.Tensor] | None = None,
                optimizers: Mapping[str, torch.optim.Optimizer] | None = None) -> str | None:
    """What makes a loaded checkpoint unusable, in words, or None: ``state`` must be a dict with ``keys``,
    its ``counters`` (dotted key -> kind) of their kind and at most their ``bounds`` (0: unbounded), every
    tensor and float finite, ``state["model"]`` with the keys, shapes and dtypes of the state dict
    ``model``, and the optimizer state at each dotted key of ``optimizers`` fitting that optimizer."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a dict"
    keys = list(keys)
    missing, extra = [key for key in keys if key not in state], [key for key in state if key not in keys]
    if missing:
        return f"it lacks {', '.join(map(repr, missing))}"
    if extra:
        return f"it has unknown {_names(extra)} (a checkpoint of something else)"
    problem = _counter_problem(state, counters, bounds or {}) or value_problem(state, "")
    if problem is None and model is not None:
        problem = model_fit_problem(state["model"], model)
    for where, optimizer in (optimizers or {}).items():
        if problem is None:
            saved, problem = _lookup(state, where)
            if problem is None and saved is not None:
                problem = optimizer_fit_problem(saved, optimizer, where)
    return problem


def value_problem(value: Any, where: str) -> str | None:
    """Where in ``value`` (nested dicts, lists and tuples) a tensor or float holds NaN or Inf, or a tensor
    claims more elements than its storage holds, and what; or None."""
    if isinstance(value, torch.Tensor):
        held = value.untyped_storage().nbytes() - value.storage_offset() * value.element_size()
        if value.numel() and not (value.is_contiguous() and held >= value.numel() * value.element_size()):
            # a tensor of overlapping or strided elements: 1e9 of them over one stored value is a few bytes on
            # disk, and an hour of reading
            return (f"{where or 'the state'} claims {value.numel():,} elements over {held:,} bytes of storage "
                    "(not a contiguous tensor as torch.save writes a state)")
        if (value.is_floating_point() or value.is_complex()) and not _finite(value):
            return f"{where or 'the state'} holds NaN or Inf"
    elif isinstance(value, float):
        if not math.isfinite(value):
            return f"{where or 'the state'} is {value}"
    elif isinstance(value, dict):
        for key, item in value.items():
            problem = value_problem(item, f"{where}[{key!r}]" if where else repr(key))
            if problem is not None:
                return problem
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            problem = value_problem(item, f"{where}[{index}]")
            if problem is not None:
                return problem
    return None


def _finite(tensor: torch.Tensor) -> bool:
    """No NaN or Inf in ``tensor``. A NaN or Inf makes the sum NaN or Inf, so a finite sum settles it in one
    reduction (10x faster than the element-wise test); a non-finite one may be an overflow of large finite
    values (half precision, sooner), which only the element-wise test tells apart."""
    if tensor.numel() == 0:
        return True
    if tensor.element_size() >= 4 and bool(torch.isfinite(tensor.sum())):
        return True
    return bool(torch.isfinite(tensor).all())


def model_fit_problem(saved: Any, model: Mapping[str, torch.Tensor]) -> str | None:
    """Whether the saved model state has the keys, shapes and dtypes of the state dict ``model``."""
    if not isinstance(saved, dict):
        return f"'model' holds a {type(saved).__name__}, not a state dict"
    missing, extra = [k for k in model if k not in saved], [k for k in saved if k not in model]
    if missing or extra:
        parts = ([f"lacks {_names(missing)}"] if missing else []) + ([f"has unknown {_names(extra)}"] if extra else [])
        return f"'model' does not fit the model: it {' and '.join(parts)}"
    return tensors_fit_problem([saved[k] for k in model], list(model.values()), [f"'model'[{k!r}]" for k in model])


def tensors_fit_problem(saved: Any, live: list[torch.Tensor], names: list[str] | str) -> str | None:
    """Whether ``saved`` is a list of tensors with the shapes and dtypes of ``live``; ``names``: each one's
    name, or the list's."""
    if isinstance(names, str):
        if not isinstance(saved, (list, tuple)) or len(saved) != len(live):
            return f"{names} is not a list of {len(live)} tensors"
        names = [f"{names}[{i}]" for i in range(len(live))]
    for name, s, t in zip(names, saved, live):
        if not isinstance(s, torch.Tensor):
            return f"{name} is a {type(s).__name__}, not a tensor"
        if s.shape != t.shape or s.dtype != t.dtype:
            return (f"{name} is {_describe(s)}, the model's is {_describe(t)} (a checkpoint of another model "
                    "or task)")
    return None


def optimizer_fit_problem(saved: Any, optimizer: torch.optim.Optimizer, where: str) -> str | None:
    """Whether ``saved`` is a state dict of ``optimizer``: as many groups and parameters per group, the
    numeric settings of each group numbers, each per-parameter tensor of its parameter's shape (or a scalar)."""
    if not (isinstance(saved, dict) and isinstance(saved.get("state"), dict)
            and isinstance(saved.get("param_groups"), list)):
        return f"'{where}' is not an optimizer state (a dict with 'state' and 'param_groups')"
    groups = saved["param_groups"]
    if len(groups) != len(optimizer.param_groups):
        return f"'{where}' has {len(groups)} parameter groups, the optimizer {len(optimizer.param_groups)}"
    parameters: dict[Any, torch.Tensor] = {}
    for index, (group, live) in enumerate(zip(groups, optimizer.param_groups)):
        if not isinstance(group, dict) or not isinstance(group.get("params"), list):
            return f"'{where}' group {index} lists no 'params'"
        if len(group["params"]) != len(live["params"]):
            return (f"'{where}' group {index} has {len(group['params'])} parameters, the optimizer's "
                    f"{len(live['params'])}")
        parameters.update(zip(group["params"], live["params"]))
        for key, value in live.items():
            if key in group and _is_number(value) and not _is_number(group[key]):
                return f"'{where}' group {index} has {key} {group[key]!r}, not a number"
    for key, per in saved["state"].items():
        if key not in parameters or not isinstance(per, dict):
            return f"'{where}' holds state for parameter {key!r}, which no group of it lists"
        for name, value in per.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != parameters[key].shape:
                return (f"'{where}' state {name!r} of parameter {key!r} has shape {tuple(value.shape)}, the "
                        f"parameter's is {tuple(parameters[key].shape)}")
    return None


def _counter_problem(state: Any, counters: Mapping[str, str], bounds: Mapping[str, float]) -> str | None:
    for name, kind in counters.items():
        value, problem = _lookup(state, name)
        if problem is not None:
            return problem
        if not _is_kind(value, kind):
            return f"counter '{name}' is {_short(value)}, not {_KINDS[kind]}"
        limit = bounds.get(name, 0)
        values = value if kind == COUNTS else value.values() if kind == COUNT_MAP else [value]
        if limit and any(v > limit for v in values):
            return f"counter '{name}' is {_short(value)}, above this run's {limit:g}"
    return None


def _lookup(state: Any, dotted: str) -> tuple[Any, str | None]:
    """``state["a"]["b"]`` for "a.b", or (None, what is missing)."""
    value = state
    for depth, key in enumerate(dotted.split(".")):
        if not isinstance(value, dict):
            above = ".".join(dotted.split(".")[:depth]) or "the checkpoint"
            return None, f"'{above}' is a {type(value).__name__}, not a dict"
        if key not in value:
            return None, f"counter '{dotted}' is missing" if depth == dotted.count(".") else f"'{dotted}' is missing"
        value = value[key]
    return value, None


def _is_kind(value: Any, kind: str) -> bool:
    if kind == COUNT:
        return is_count(value)
    if kind == COUNTS:
        return isinstance(value, (list, tuple)) and all(is_count(v) for v in value)
    if kind == COUNT_MAP:
        return isinstance(value, dict) and all(is_count(k) and is_count(v) for k, v in value.items())
    if not _is_number(value) or (isinstance(value, float) and not math.isfinite(value)):
        return False
    return value > 0 if kind == POSITIVE else value >= 0


def is_count(value: Any) -> bool:
    """An int >= 0 that is not a bool."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _describe(tensor: torch.Tensor) -> str:
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


def _names(keys: list[Any]) -> str:
    shown = ", ".join(map(repr, keys[:3]))
    return shown + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")


def _short(value: Any) -> str:
    text = repr(value)
    return (text if len(text) <= 40 else text[:37] + "...") + f" (a {type(value).__name__})"


def _read_error(exc: BaseException) -> str:
    """torch's reason in a few words: its messages run to several lines of advice."""
    text = str(exc)
    if "WeightsUnpickler error:" in text:  # garbage, or a pickle of something other than tensors and values
        detail = " ".join(text.split("WeightsUnpickler error:", 1)[1].split("Check the documentation")[0].split())
        detail = detail.split(". ", 1)[0]
        return f"not a checkpoint of tensors and plain values ({detail or type(exc).__name__})"
    first = _first_line(exc)
    sentence = first.split(". ", 1)[0]
    return sentence if len(sentence) <= 200 else sentence[:197] + "..."


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _fsync_directory(directory: Path) -> None:
    """Make the renames themselves durable (the directory entries live in the directory's own blocks)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
