"""`llmem.quiet.quiet_libraries`: the libraries' warnings are silenced inside the block, and only there."""

import logging
import warnings

from transformers.utils import logging as hf_logging

from llmem.quiet import QUIET_LOGGERS, quiet_libraries


def test_silenced_inside_and_restored_after(caplog):
    before = hf_logging.get_verbosity()
    levels = {name: logging.getLogger(name).level for name in QUIET_LOGGERS}
    with caplog.at_level(logging.WARNING), quiet_libraries():
        for name in QUIET_LOGGERS:
            logging.getLogger(name).warning("inside")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            warnings.warn("recorded: the block's filter is replaced by the inner one", stacklevel=1)
        assert len(caught) == 1
        assert hf_logging.get_verbosity() == hf_logging.ERROR
    assert not [r for r in caplog.records if r.getMessage() == "inside"]
    assert hf_logging.get_verbosity() == before
    assert {name: logging.getLogger(name).level for name in QUIET_LOGGERS} == levels
    with caplog.at_level(logging.WARNING):
        logging.getLogger("torchao").warning("outside")
    assert [r for r in caplog.records if r.getMessage() == "outside"]


def test_python_warnings_ignored_inside():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_libraries():
            warnings.warn("deprecated", DeprecationWarning, stacklevel=1)
        warnings.warn("after", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["after"]
