"""The docs pages whose examples are Python sessions run as doctests, as the modules' do.

A file of its own, one test long: what it tests is docs/, which no module's test file covers."""
import doctest
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
PAGES = ["gguf-kquants.md"]


@pytest.mark.parametrize("page", PAGES)
def test_the_page_runs(page):
    result = doctest.testfile(str(DOCS / page), module_relative=False, verbose=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 10 and result.failed == 0, result
