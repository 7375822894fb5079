"""`@rank_consensus`: record a call (and optionally some arguments and the result) as an event.

    @rank_consensus                         # one event per call: the call ORDER must agree
    def schedule_step(self) -> None: ...

    @rank_consensus(args=("rid", "num_tokens"), result=True)
    def admit(self, rid: str, num_tokens: int) -> bool: ...

    @rank_consensus(args={"batch": lambda b: [r.rid for r in b.reqs]}, result=lambda out: out.forward_mode)
    def run_batch(self, batch: ScheduleBatch) -> Result: ...

`args` names parameters of the decorated function (a sequence of names, or a mapping from name to
a function that maps the value to plain data); `result` is False, True (record the return value)
or a function applied to it; `name` overrides the event name (default: the function's qualname).
The payload is a dict {param: value, ..., "return": result}, or None for a bare decorator.
Without `result` the event is recorded when the call starts; with `result`, when it returns (or
raises: then "raise" holds the exception's type name and the exception propagates).

Cost when the checker is disabled: the wrapper call plus one module-attribute load and a branch
(tests/test_consensus.py bounds it). When enabled: canonical text + blake2b + a lock per event.
Measured figures: docs/performance.md.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ParamSpec, TypeVar, overload

from consensus import event_log

P = ParamSpec("P")
R = TypeVar("R")

_MISSING = object()

ArgSelector = Sequence[str] | Mapping[str, Callable[[Any], object]]
ResultSelector = bool | Callable[[Any], object]


@overload
def rank_consensus(fn: Callable[P, R], /) -> Callable[P, R]: ...


@overload
def rank_consensus(
    *, args: ArgSelector = (), result: ResultSelector = False, name: str | None = None
) -> Callable[[Callable[P, R]], Callable[P, R]]: ...


def rank_consensus(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    args: ArgSelector = (),
    result: ResultSelector = False,
    name: str | None = None,
) -> Any:
    if fn is not None:
        return _wrap(fn, args, result, name)
    return lambda f: _wrap(f, args, result, name)


def _wrap(fn: Callable[P, R], args: ArgSelector, result: ResultSelector, name: str | None) -> Callable[P, R]:
    if isinstance(args, str):
        raise TypeError(
            f"rank_consensus(args=...) wants a sequence of parameter names, got the string {args!r}"
        )
    event_name = name or fn.__qualname__
    pick = _arg_picker(fn, args)
    project_result = result if callable(result) else None

    if result is False:

        @functools.wraps(fn)
        def record_on_entry(*a: P.args, **kw: P.kwargs) -> R:
            if event_log.ENABLED:
                event_log.LOG.append(event_name, pick(a, kw))
            return fn(*a, **kw)

        return record_on_entry

    @functools.wraps(fn)
    def record_on_exit(*a: P.args, **kw: P.kwargs) -> R:
        if not event_log.ENABLED:
            return fn(*a, **kw)
        payload = pick(a, kw) or {}
        try:
            out = fn(*a, **kw)
        except BaseException as exc:
            event_log.LOG.append(event_name, {**payload, "raise": type(exc).__qualname__})
            raise
        event_log.LOG.append(
            event_name, {**payload, "return": project_result(out) if project_result else out}
        )
        return out

    return record_on_exit


def _arg_picker(
    fn: Callable[..., Any], args: ArgSelector
) -> Callable[[tuple[Any, ...], dict[str, Any]], Any]:
    """Resolves parameter names to positions once, at decoration time."""
    if not args:
        return lambda a, kw: None
    projections: Mapping[str, Callable[[Any], object] | None] = (
        args if isinstance(args, Mapping) else dict.fromkeys(args, None)
    )
    params = list(inspect.signature(fn).parameters.values())
    by_name = {p.name: (i, p) for i, p in enumerate(params)}
    selectors: list[tuple[str, int | None, object, Callable[[Any], object] | None]] = []
    for pname, project in projections.items():
        if pname not in by_name:
            raise ValueError(
                f"rank_consensus(args=...) names {pname!r}, which is not a parameter of "
                f"{fn.__qualname__}{inspect.signature(fn)}"
            )
        index, param = by_name[pname]
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise ValueError(
                f"rank_consensus(args=...) cannot select *{pname} / **{pname} of {fn.__qualname__}"
            )
        position = index if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) else None
        default = _MISSING if param.default is param.empty else param.default
        selectors.append((pname, position, default, project))

    def pick(a: tuple[Any, ...], kw: dict[str, Any]) -> dict[str, object]:
        out: dict[str, object] = {}
        for pname, position, default, project in selectors:
            if position is not None and position < len(a):
                value = a[position]
            else:
                value = kw.get(pname, default)
            if value is _MISSING:  # the call itself will raise TypeError
                value = None
            out[pname] = project(value) if project else value
        return out

    return pick
