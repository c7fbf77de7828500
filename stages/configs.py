"""DVC stage `configs`: every derived config from params.yaml + the verifier's config.json.
See src/eagle3pipe/draft/formats.py."""
from eagle3pipe.draft import formats
from eagle3pipe.stages import runner as stage

if __name__ == "__main__":
    stage.main("configs", formats.run, paths=("verifier", "out"), doc=__doc__)
