"""docs/api.md is what `python -m ds_tsp.tools.api_doc --write` writes from the public faces' __all__, so it cannot
drift: a name added to (or dropped from) a face, a changed signature or docstring fails here until it is
regenerated."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

from ds_tsp.tools import api_doc

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("transformers")  # ds_tsp.hf's trainers: documented only where they import
pytest.importorskip("trl")


def test_check_passes(capsys):
    """`python -m ds_tsp.tools.api_doc --check`, in process (the faces are imported already)."""
    assert api_doc.main(["--check", "--root", str(ROOT)]) == 0, (
        "docs/api.md is stale: run python -m ds_tsp.tools.api_doc --write\n" + capsys.readouterr().out[-6000:])


def test_a_new_public_name_makes_the_check_fail(monkeypatch, capsys):
    import ds_tsp.testing

    def brand_new_helper(x: int) -> int:
        """A name nobody documented."""
        return x

    monkeypatch.setattr(ds_tsp.testing, "brand_new_helper", brand_new_helper, raising=False)
    monkeypatch.setattr(ds_tsp.testing, "__all__", [*ds_tsp.testing.__all__, "brand_new_helper"])
    assert api_doc.main(["--check", "--root", str(ROOT)]) == 1
    printed = capsys.readouterr()
    assert "+### `ds_tsp.testing.brand_new_helper`" in printed.out  # the diff names it
    assert "api_doc --write" in printed.err


def test_write_makes_a_stale_file_current(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "api.md", tmp_path / "docs" / "api.md")
    (tmp_path / "docs" / "api.md").write_text((tmp_path / "docs" / "api.md").read_text().replace("*function*", "*f*"))
    assert api_doc.main(["--check", "--root", str(tmp_path)]) == 1
    assert api_doc.main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "docs" / "api.md").read_text() == (ROOT / "docs" / "api.md").read_text()


def test_the_text_is_deterministic():
    text = api_doc.render()
    assert " at 0x" not in text and str(ROOT) not in text  # no addresses, no absolute paths
    assert text == api_doc.render()
    for face in api_doc.FACES:  # one section per face, one entry per exported name
        module = sys.modules[face]
        assert f"## `{face}`\n" in text
        for name in module.__all__:
            assert f"### `{face}.{name}`\n" in text, (face, name)
