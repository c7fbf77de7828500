"""DVC stage `configs`: every derived config from params.yaml + the verifier's config.json.
See src/eagle3pipe/render.py."""
from eagle3pipe import render, stage

if __name__ == "__main__":
    stage.main("configs", render.run, paths=("verifier", "out"), doc=__doc__)
