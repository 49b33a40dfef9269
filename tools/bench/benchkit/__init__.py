"""What the benchmarks in tools/bench share (the scripts import it as `benchkit`: their
directory is the first entry of sys.path).

- facts and statistics (re-exported here): paths under runs/, machine, versions, git,
  summaries and medians, CPU from /proc and the shared-box guard, JSON and PNG output;
- `benchkit.harness`: the one process harness (narwhal-sim fleets, Narwhal, vllm-router,
  the load generator, a state sampler), every child stopped by its PID;
- `benchkit.workload` and `benchkit.attainment`: the Azure-trace workloads with their
  capacity model, and SLO attainment and goodput over offered requests.

The load generator itself is tools/bench/loadgen.py, a process of its own.
"""

from ._cpu import (
    GUARD_CORES as GUARD_CORES,
    cpu_seconds as cpu_seconds,
    descendants as descendants,
    disturbance as disturbance,
    machine_cpu_seconds as machine_cpu_seconds,
    measure_guarded as measure_guarded,
    rotated as rotated,
    tree_cpu_seconds as tree_cpu_seconds,
    wait_quiet as wait_quiet,
)
from ._facts import (
    BENCH as BENCH,
    REPO as REPO,
    RUNS as RUNS,
    TMP as TMP,
    Json as Json,
    git_revision as git_revision,
    load_average as load_average,
    machine as machine,
    versions as versions,
)
from ._output import (
    INSTALL_HINT as INSTALL_HINT,
    PlotUnavailable as PlotUnavailable,
    draw as draw,
    publish as publish,
    pyplot as pyplot,
    save_figure as save_figure,
    show as show,
    write_json as write_json,
)
from ._stats import mean as mean, median as median, rounded as rounded, summarize as summarize
