"""The lm-evaluation-harness adapter: the ``grt`` model class, downstream tasks at several depths, their task configs
and data loaders (tasks/), and the start-up hook that registers ``grt`` with lm-eval."""
