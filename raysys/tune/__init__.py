"""Speed/quality sweeps: ``python -m raysys.tune --space tune_spaces/<workload>.yaml``.

space.py       the YAML space: knobs as dotted config paths with domains, validated up front
objectives.py  throughput and quality objectives, the stability verdict and its penalty
pareto.py      Pareto front and the recommendation (pure functions)
trial.py       the Tune function trainable (in-process child, Train V2 workers, or a custom loop)
child.py       the child process that trains one in-process trial
progress.py    driver side while running: stability stopper, progress lines
resources.py   per-trial resources and max concurrency from the cluster (no deadlock)
runner.py      Tuner/OptunaSearch, resume, MLflow parent run
report.py      table, recommended commands, MLflow child tags and parent artifacts
plot.py        the Pareto plot
searcher.py    Optuna told of a trial without finite objectives as failed
population.py  --vectorize K: K configurations per trial, one record and MLflow run per member
whole_files.py the local file system Tune writes the sweep's state through (whole files or none)
sweep_bench.py the same sweep one trial per configuration vs vectorized

Light on import: Ray, Optuna and MLflow load only when a sweep runs.
"""
