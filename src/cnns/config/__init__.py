"""A run's configuration: the options table, configs.yml, Graphcore's application's default
rules, the frozen RunConfig.

* `table`: every option of every script of Graphcore's application (argparse), and the IPU-only options
  accepted with a notice.
* `files`: configs.yml read, and values checked against the table's types.
* `defaults`: Graphcore's application's rules that fill and check every option (`resolve`, and the
  device's and the random seed's defaults), giving the flat options that
  ``arguments.json`` and ``--print-config`` show.
* `run`: `RunConfig`, the frozen, typed form that the commands build once per process and everything below
  them reads.
"""

from cnns.config.defaults import EXPONENTIAL_DECAY_RATE, EXPONENTIAL_DROPS, resolve, run_name
from cnns.config.config_files import check_domains, check_option_types, default_configs_path, load_named_config
from cnns.config.run import (DataConfig, LogConfig, OptimConfig, ParallelConfig, PrecisionConfig, RunConfig,
                             TrainConfig, parse_fractions)

__all__ = [
    "EXPONENTIAL_DECAY_RATE", "EXPONENTIAL_DROPS", "DataConfig",
    "LogConfig", "OptimConfig", "ParallelConfig", "PrecisionConfig", "RunConfig", "TrainConfig",
    "check_domains", "check_option_types", "default_configs_path", "load_named_config",
    "parse_fractions", "resolve", "run_name",
]
