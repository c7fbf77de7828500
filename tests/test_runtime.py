"""A stage reading another stage's JSON output: every broken input names the file (and line)
and the command that regenerates it, whichever stage reads it (the readers and the broken
files: helpers/malformed.py's READERS and BROKEN)."""
import re

import pytest

from eagle3pipe.verifier import handle as verifier
from eagle3pipe.errors import Error
from helpers.malformed import BROKEN, READERS


@pytest.mark.parametrize("broken", sorted(BROKEN))
@pytest.mark.parametrize("reader", sorted(READERS))
def test_broken_generated_json_names_file_line_and_fix(tmp_path, reader, broken):
    read, error, rel, fix = READERS[reader]
    text, what = BROKEN[broken]
    path = tmp_path / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    with pytest.raises(error) as e:
        read(tmp_path)
    msg = str(e.value)
    assert isinstance(e.value, Error)  # the stage runner prints it without a traceback
    assert fix in msg, msg
    assert re.search(re.escape(str(path)) + what, msg), msg


@pytest.mark.parametrize("reader", ["extract.read_capture", "parsing.read_draft_config",
                                    "smoke.speculative_tokens"])
def test_missing_generated_json_names_file_and_fix(tmp_path, reader):
    read, error, rel, fix = READERS[reader]
    with pytest.raises(error, match="not found") as e:
        read(tmp_path)
    assert str(tmp_path / rel) in str(e.value) and fix in str(e.value)


def test_missing_manifest_means_plain_checkpoint(tmp_path):
    assert verifier.read_manifest(tmp_path) is None
