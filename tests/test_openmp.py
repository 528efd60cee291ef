"""Building off the caller's thread: the result or the error comes back, and the thread is gone."""

from __future__ import annotations

import threading

import pytest

from verispec.openmp import off_main_thread


def test_a_build_runs_on_a_thread_that_ends_and_its_error_comes_back():
    main = threading.get_ident()
    builder = off_main_thread(threading.get_ident)
    assert builder != main and not any(t.ident == builder for t in threading.enumerate())
    with pytest.raises(ValueError, match="bad model"):
        off_main_thread(lambda: int("bad model"))
