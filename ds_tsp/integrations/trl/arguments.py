"""A TRL trainer's call bound by name: TRL's trainers take other positional orders than TSPTrainer's (model, args,
...), e.g. GRPOTrainer / RLOOTrainer (model, reward_funcs, args, ...) and DPOTrainer (model, ref_model, args, ...)."""
from __future__ import annotations

import inspect

from ds_tsp.core.errors import TSPConfigError


def bind_by_name(init, model, args, more: tuple, kwargs: dict, trainer: str, keywords: str) -> tuple:
    """(model, args, the other arguments by name) of a call of `init` (the bound __init__ after TSPTrainer's: the
    TRL trainer's, or a user subclass's) given as TSPTrainer received it. A call that does not bind is one
    TSPConfigError naming `trainer` and the keywords to pass instead."""
    if not more:
        return model, args, kwargs
    try:
        given = dict(inspect.signature(init).bind(model, args, *more, **kwargs).arguments)
    except TypeError as err:
        raise TSPConfigError(f"{trainer} arguments: {err}; pass them by keyword ({keywords})") from err
    given.update(given.pop("kwargs", {}))
    return given.pop("model", None), given.pop("args", None), given
