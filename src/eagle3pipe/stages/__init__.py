"""One module per DVC stage, each exposing `run(params, paths) -> metrics`, and the runner that
every stage script calls (runner). No module here imports eagle3pipe.tools."""
