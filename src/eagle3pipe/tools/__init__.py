"""The commands around the pipeline (cli, plan, check, scan, invalidation, deps). No stage imports
these, so editing a tool reruns no stage."""
