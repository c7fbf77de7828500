"""DVC stage `configs`: every derived config from params.yaml + the verifier's config.json.
See src/eagle3pipe/stages/configs/run.py."""
from eagle3pipe.stages import runner
from eagle3pipe.stages.configs import run as configs
if __name__ == "__main__":
    runner.main("configs", configs.run, paths=("verifier", "out"),
                doc=__doc__)
