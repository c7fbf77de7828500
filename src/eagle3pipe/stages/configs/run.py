"""The configs stage: every derived config under configs/ rendered from params.draft and the
verifier's config.json (the draft's layouts: eagle3pipe.draft.formats; the capture spec:
eagle3pipe.hidden.spec), and the serving recipe under configs/serve/ from
params.draft.num_speculative_tokens, verifier.path and the vllm: section
(eagle3pipe.engines.serving); files whose bytes are unchanged are not touched, so a rerun that
writes identical bytes invalidates nothing downstream (no stage depends on configs/serve/).
`eagle3pipe render` and `eagle3pipe check` use render_files and render_into."""
from __future__ import annotations

import logging
from pathlib import Path

from eagle3pipe.config.view import StageView
from eagle3pipe.draft import formats
from eagle3pipe.draft.arch import derive
from eagle3pipe.engines import serving
from eagle3pipe.hidden import spec
from eagle3pipe.runtime.jsonio import dumps
from eagle3pipe.stages.runner import Paths
from eagle3pipe.verifier.handle import VerifierInfo, read_config

CAPTURE = "capture.json"


def render_files(draft, verifier_path: str | None, verifier_config_file: str | Path, *,
                 params_file: str = "params.yaml", lines: dict | None = None) -> dict[str, str]:
    """params' draft section + the verifier's config.json -> every derived config's text (the
    draft's layouts and capture.json; the serving recipe is eagle3pipe.engines.serving's)."""
    info = VerifierInfo.from_config(verifier_config_file)
    arch = derive(draft, info, params_file=params_file, lines=lines)
    cfg, _, _ = read_config(verifier_config_file)
    files = formats.render(arch, verifier_config=cfg, verifier_path=verifier_path,
                           num_speculative_tokens=draft.num_speculative_tokens)
    # written in this order, the verifier's config last (tests/test_faults.py holds it)
    last = "verifier_config.json"
    return {**{k: v for k, v in files.items() if k != last},
            CAPTURE: dumps(spec.render(arch)), last: files[last]}


def render_into(out_dir: str | Path, draft, verifier_path: str | None,
                verifier_config_file: str | Path, *, params_file: str = "params.yaml",
                lines: dict | None = None) -> dict[Path, str]:
    """render_files() written under out_dir: {path: "written" or "unchanged"}."""
    files = render_files(draft, verifier_path, verifier_config_file, params_file=params_file,
                         lines=lines)
    changed = set(formats.write(files, out_dir))
    return {Path(out_dir) / rel: "written" if Path(out_dir) / rel in changed else "unchanged"
            for rel in files}


def run(params: StageView, paths: Paths) -> None:
    """The configs stage (eagle3pipe.stages.runner.main): params.draft + paths.verifier (its
    config.json) -> every derived config under paths.out; files whose bytes are unchanged are
    not touched."""
    states = render_into(paths.out, params.draft, params.verifier.path, paths.verifier,
                         params_file=params.params_file, lines=params.key_lines)
    states |= serving.render_into(paths.out, params)
    for path, state in states.items():
        logging.getLogger("eagle3pipe.stages.configs").info("%s %s", path, state)
