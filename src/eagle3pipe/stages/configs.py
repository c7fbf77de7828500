"""The configs stage: every derived config under configs/ rendered from params.draft and the
verifier's config.json (eagle3pipe.draft.formats), and the serving recipe under configs/serve/
from params.draft.num_speculative_tokens, verifier.path and the vllm: section
(eagle3pipe.draft.serving); files whose bytes are unchanged are not touched, so a rerun that
writes identical bytes invalidates nothing downstream (no stage depends on configs/serve/)."""
from __future__ import annotations

import logging

from eagle3pipe.config.view import StageView
from eagle3pipe.draft import formats, serving
from eagle3pipe.stages.runner import Paths


def run(params: StageView, paths: Paths) -> None:
    """The configs stage (eagle3pipe.stages.runner.main): params.draft + paths.verifier (its config.json)
    -> every derived config under paths.out; files whose bytes are unchanged are not touched."""
    states = formats.render_into(paths.out, params.draft, params.verifier.path, paths.verifier,
                         params_file=params.params_file, lines=params.key_lines)
    states |= serving.render_into(paths.out, params.vllm, params.verifier.path,
                                  params.draft.num_speculative_tokens)
    for path, state in states.items():
        logging.getLogger(__name__).info("%s %s", path, state)
