"""A stage reading another stage's JSON output: every broken input names the file (and line)
and the command that regenerates it, whichever stage reads it."""
import re

import pytest

from eagle3pipe.stages import extract
from eagle3pipe.draft import formats
from eagle3pipe.stages import smoke
from eagle3pipe.verifier import handle as verifier
from eagle3pipe.errors import Error

# (reader, error class, file it reads relative to the directory it is given, fix it must name)
READERS = {
    "extract.read_capture": (lambda d: extract.read_capture(d / "capture.json"),
                             extract.ExtractError, "capture.json", "dvc repro configs"),
    "formats.read_draft_config": (lambda d: formats.read_draft_config(d / "draft_config.json"),
                                  formats.ConfigError, "draft_config.json", "dvc repro configs"),
    "smoke.speculative_tokens": (lambda d: smoke.speculative_tokens(d),
                                 smoke.SmokeError, "speculators/config.json", "dvc repro export"),
    "verifier.read_manifest": (lambda d: verifier.read_manifest(d), verifier.VerifierError,
                               verifier.MANIFEST, "dvc repro -f -s verifier"),
}
# (bytes of the file, what the message must say after the file name)
BROKEN = {
    "invalid_json": (b'{\n  "a": 1,\n  oops\n}\n', r":3: invalid JSON"),
    "not_an_object": (b"[1, 2, 3]\n", ": expected a JSON object, got a JSON array"),
    "not_utf8": (b'{\n  "a": "caf\xe9"\n}\n', r":2: not UTF-8 text \(byte 0xe9 at offset 13"),
    "utf16": ('{"a": 1}'.encode("utf-16"), r":1: not UTF-8 text \(byte 0xff at offset 0"),
    "nan": (b'{\n  "note": "NaN in a string is fine",\n  "rms_norm_eps": NaN\n}\n',
            r":3: NaN is not JSON"),
    "infinity": (b'{"rope_theta": -Infinity}', r":1: -Infinity is not JSON"),
    "truncated": (b'{\n  "a": [1,\n', r":3: invalid JSON"),
    "empty": (b"", r":1: invalid JSON"),
    "bom": (b'\xef\xbb\xbf{"a": 1}', r":1: invalid JSON \(Unexpected UTF-8 BOM"),
    "too_deep": (b"[" * 100_000 + b"]" * 100_000, r": invalid JSON \(nested too deeply"),
}


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


@pytest.mark.parametrize("reader", ["extract.read_capture", "formats.read_draft_config",
                                    "smoke.speculative_tokens"])
def test_missing_generated_json_names_file_and_fix(tmp_path, reader):
    read, error, rel, fix = READERS[reader]
    with pytest.raises(error, match="not found") as e:
        read(tmp_path)
    assert str(tmp_path / rel) in str(e.value) and fix in str(e.value)


def test_missing_manifest_means_plain_checkpoint(tmp_path):
    assert verifier.read_manifest(tmp_path) is None
