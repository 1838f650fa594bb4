"""Quiet the libraries llmem drives while it traces or builds a model: transformers' config warnings (e.g. a token
id outside a small vocabulary), the import-time warnings of torchao (each CUDA extension a CPU-only machine cannot
load; enums torch's pytree warns about) and bitsandbytes (its missing CPU kernels package), and their deprecation
notes would print beside the estimate, whose own errors are one line. Nothing else is silenced."""

from __future__ import annotations

import contextlib
import logging
import warnings

QUIET_LOGGERS = ("torchao", "torch.utils._pytree", "bitsandbytes")


@contextlib.contextmanager
def quiet_libraries():
    """Within the block: transformers' logging at error level, `QUIET_LOGGERS` at ERROR, Python warnings ignored;
    each restored after."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [log.level for log in loggers]
    hf_logging.set_verbosity_error()
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        for log, old in zip(loggers, levels, strict=True):
            log.setLevel(old)
