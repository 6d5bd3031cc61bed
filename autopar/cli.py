"""The ``autopar`` command line.

In: ``sys.argv``. Out: exit status and text. 0: done; 2: a user's error (an autopar error, a
file that cannot be read or written, a bad flag), one line on stderr; 1: a bug in autopar, its
traceback and a request to report it; 130: interrupted. ``autopar --debug COMMAND`` adds the
traceback to a user's error.
Subcommands (``autopar COMMAND --help`` describes each):
- ``plan MODULE:FUNCTION``: call FUNCTION (in a module path or a ``.py`` file) for
  ``(step, args)`` or ``(step, args, options)`` (options: ``ap.compile`` keywords such as
  ``batch_argnums``/``in_strategy``), plan the step under the given flags without running it
  (arguments may be ``jax.ShapeDtypeStruct``s), print the summary and save the strategy;
- ``show STRATEGY``: the strategy table; ``report STRATEGY -o report.html``: the HTML report;
- ``solve PROBLEM TIMEOUT``: an IOPDDL problem, the chosen strategy indices last on stdout
  (``--json``: one object with the cost, the proven lower bound and gap, and the choice), the
  cost, lower bound and gap on stderr;
- ``calibrate``: measure this machine's cost-model constants again (the cache plans use);
- ``bench``: the native collectives' latency and bus bandwidth (``autopar.tools.bench``);
- ``launch SCRIPT``: run SCRIPT as this host's processes of a multi-process JAX job
  (``autopar.runtime.jax_launch``); its exit status is the job's.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import sys
import time

from .argtypes import at_least
from .errors import AutoparError, ConfigError, InfeasibleError, LayoutError


class UserCodeError(ConfigError):
    """The user's module or function (``autopar plan MODULE:FUNCTION``) raised."""


def _load_function(target: str):
    module, _, name = target.rpartition(":")
    if not module or not name:
        raise ConfigError(
            f"{target!r}: write MODULE:FUNCTION, e.g. examples/gpt_auto.py:build "
            "or mypackage.models:build."
        )
    try:
        if module.endswith(".py") or os.path.sep in module:
            if not os.path.isfile(module):
                raise ConfigError(f"{module}: no such file.")
            sys.path.insert(0, os.path.dirname(os.path.abspath(module)))
            spec = importlib.util.spec_from_file_location(
                os.path.splitext(os.path.basename(module))[0], module
            )
            if spec is None or spec.loader is None:  # not a Python source file
                raise ConfigError(f"{module}: not a Python file (give a .py file).")
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
        else:
            sys.path.insert(0, os.getcwd())
            mod = importlib.import_module(module)
    except ConfigError:
        raise
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"{module}: no module named {e.name!r} (give a .py file or a module "
            "importable from here)."
        ) from e
    except Exception as e:  # noqa: BLE001 -- the user's module, reported as theirs
        raise UserCodeError(f"importing {module} raised {type(e).__name__}: {e}") from e
    if not hasattr(mod, name):
        raise ConfigError(f"{module} has no function {name!r}.")
    return getattr(mod, name)


def _writable(path: str) -> str:
    """``path``, or ConfigError when a file cannot be written there (checked before long work)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{path} is a folder; give a file name to write.")
    if not os.path.isdir(folder):
        raise ConfigError(f"cannot write {path}: the folder {folder} does not exist.")
    if not os.access(folder, os.W_OK):
        raise ConfigError(f"cannot write {path}: the folder {folder} is not writable.")
    return path


def _count_or_auto(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a count or auto") from None


def _stage_devices(text: str):
    if text in ("auto", "equal"):
        return text
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: write auto, equal or counts such as 1,3"
        ) from None


def _mesh(text):
    try:
        return tuple(int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: write the mesh as e.g. 8 or 2x4") from None


def _plan(args) -> int:
    import autopar as ap

    _writable(args.output)
    devices = args.devices or (int(__import__("math").prod(args.mesh)) if args.mesh else 1)
    config = ap.ParallelConfig(
        parallel_mode=args.mode,
        device_num=devices,
        mesh_shape=args.mesh,
        topology=ap.Topology.preset(args.topology, devices) if args.topology else None,
        search_mode=args.search,
        max_device_memory=args.max_memory,
        search_time=args.search_time,
        pipeline_stages=args.stages,
        micro_batches=args.micro_batches,
        pipeline_scheduler=args.scheduler,
        pipeline_stage_devices=args.stage_devices,
        enable_parallel_optimizer=args.optimizer_level is not None,
        optimizer_level=args.optimizer_level or "level1",
    )
    build = _load_function(args.target)
    try:
        got = build()
    except Exception as e:  # noqa: BLE001 -- the user's function, reported as theirs
        raise UserCodeError(f"{args.target} raised {type(e).__name__}: {e}") from e
    if (
        not isinstance(got, tuple)
        or len(got) not in (2, 3)
        or not callable(got[0])
        or not isinstance(got[2] if len(got) == 3 else {}, dict)
    ):
        raise ConfigError(
            f"{args.target} must return (step, args) or (step, args, options), "
            f"options a dict of ap.compile keywords; it returned {type(got).__name__}."
        )
    step, example, options = got[0], tuple(got[1]), (got[2] if len(got) == 3 else {})
    known = set(inspect.signature(ap.plan).parameters) - {"fn", "args", "config"}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ConfigError(
            f"{args.target} returned options {unknown} that ap.plan does not take; "
            f"it takes {sorted(known)} (the mode and mesh come from this "
            "command's own options)."
        )
    start = time.monotonic()
    strategy = ap.plan(step, *example, config=config, **options)
    if strategy.alternatives:  # why this plan, first
        print(strategy.explain() + "\n")
    print(strategy.table().split("\n\n")[0])  # the table's head: estimate, memory, stages
    print(
        f"planned in {time.monotonic() - start:.1f} s: "
        + ", ".join(f"{k} {v:.2f} s" for k, v in strategy.phase_seconds)
    )
    strategy.save(args.output, format=args.format)
    as_json = args.output.endswith(".json")
    kind = args.format or ("autopar" if as_json else "mindspore")
    print(
        f"saved {args.output} ("
        + (
            "autopar JSON"
            if kind == "autopar"
            else "MindSpore " + ("JSON" if as_json else "protobuf")
        )
        + ")"
    )
    return 0


def _launch(args) -> int:
    from .runtime.jax_launch import LaunchOptions, launch

    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return launch(
        LaunchOptions(
            tuple(command),
            args.nprocs,
            args.devices_per_process,
            args.nnodes,
            args.node_rank,
            args.coordinator,
        )
    )


def _show(args) -> int:
    from .strategies.strategy import Strategy

    strategy = Strategy.load(args.strategy)
    if args.top is None and args.by is None:
        print(strategy.table())
        return 0
    if not isinstance(strategy, Strategy):
        raise LayoutError(
            f"{strategy}: --top and --by summarise autopar's estimates, which "
            "MindSpore's files do not hold; `autopar show` lists its layouts."
        )
    from .strategies.summary import summary

    print(summary(strategy, args.top or 10, args.by or "operator"))
    return 0


def _report(args) -> int:
    from . import report
    from .strategies.strategy import Strategy

    _writable(args.output)
    strategy = Strategy.load(args.strategy)
    if not isinstance(strategy, Strategy):
        raise LayoutError(
            f"{strategy}: a report shows autopar's estimates, which MindSpore's "
            "files do not hold; `autopar show` lists its layouts."
        )
    report.save(strategy, args.output)
    print(f"wrote {args.output}")
    return 0


def _process_start() -> float:
    """``time.monotonic()``'s reading when this process started (Linux: /proc), so that a time
    limit given on the command line covers the interpreter's start and the imports, as a
    contest's wall clock does; now where /proc cannot tell."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        age = uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        age = 0.0
    return time.monotonic() - max(age, 0.0)


def _solve(args) -> int:
    from .strategies.problem import SearchProblem
    from .strategies.solvers import get

    start = _process_start() if args.own_process else time.monotonic()
    if not args.timeout > 0 or args.timeout == float("inf"):
        raise ConfigError(
            f"timeout {args.timeout:g}: give the seconds the run may take, a finite number > 0."
        )
    solve = get(args.solver)
    read = time.monotonic()
    problem = SearchProblem.load(args.problem)
    loaded = time.monotonic() - read
    say = lambda msg: print(
        f"[{time.monotonic() - start:7.1f}s] {msg}", file=sys.stderr, flush=True
    )
    say(
        f"{problem.name}: {problem.num_nodes} nodes, {problem.num_edges} edges, limit "
        f"{problem.usage_limit} (read in {loaded:.1f}s)"
    )
    left = args.timeout - (time.monotonic() - start)
    solution, why = _solve_anytime(solve, problem, max(left, 1.0), say)
    if solution is None:
        raise InfeasibleError(
            f"{problem.name}: {why} before any feasible answer was found; give it more time."
        )
    if why:
        say(f"{why}: answering with the best feasible answer so far")
    lb, gap = solution.lower_bound, solution.gap
    say(
        f"cost {solution.cost:.10g}, peak memory {solution.peak} of {problem.usage_limit}, "
        f"solver {solution.solver}{' (optimal)' if solution.optimal else ''}; "
        + ("no lower bound proved" if lb is None else f"lower bound {lb:.10g}, gap {gap:.4%}")
    )
    if args.json:
        print(
            json.dumps(
                {
                    "problem": problem.name,
                    "cost": solution.cost,
                    "peak": solution.peak,
                    "usage_limit": problem.usage_limit,
                    "lower_bound": lb,
                    "gap": gap,
                    "optimal": solution.optimal,
                    "solver": solution.solver,
                    "seconds": round(time.monotonic() - start, 3),
                    "choice": list(solution.choice),
                }
            ),
            flush=True,
        )
    else:
        print(solution, flush=True)
    # the answer is out: a command ends now, not after the interpreter frees the search's
    # memory (a second or more on the large problems, counted against the time limit); and
    # no caller waits for a solver thread that may sit in native code
    if args.own_process or why:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


GRACE = 0.5  # seconds past its time limit a solver may take before the best offer is
# answered instead (solvers aim to return a margin before the limit)


def _solve_anytime(solve, problem, limit, say) -> tuple:
    """``(Solution or None, why it stopped early or "")``: ``solve`` runs in a thread while
    offers of its best answers are watched (solvers/anytime.py); a SIGINT (Ctrl-C), or the
    solver still running ``GRACE`` seconds past ``limit``, ends the wait with the best offer."""
    import threading

    from .strategies.problem import Solution
    from .strategies.solvers import anytime

    done = {}

    def work():
        try:
            done["solution"] = solve(problem, time_limit=limit, progress=say)
        except BaseException as e:  # noqa: BLE001 -- raised again in the caller
            done["error"] = e

    with anytime.watch() as watched:
        thread = threading.Thread(target=work, name="autopar-solve", daemon=True)
        t0 = time.monotonic()
        why = ""
        try:  # a SIGINT may land while start() waits for the thread
            thread.start()
            # joined in short waits: the kernel may hand a SIGINT to the solver's thread,
            # and then only a wait that ends notices it (one long join slept through it)
            while thread.is_alive() and time.monotonic() < t0 + limit + GRACE:
                thread.join(min(0.1, max(0.0, t0 + limit + GRACE - time.monotonic())))
            if thread.is_alive():
                why = f"still searching {GRACE:g} s past the time limit"
        except KeyboardInterrupt:
            why = f"interrupted after {time.monotonic() - t0:.1f} s"
        if not why:
            if "error" in done:
                raise done["error"]
            return done["solution"], ""
        best = watched.best()
    if best is None:
        return None, why
    return Solution.of(problem, best[1], "anytime"), why


def _calibrate(args) -> int:
    from .tools.calibrate import cache_path, calibrate, save

    if args.devices < 2:
        raise ConfigError(
            f"--devices {args.devices}: calibrate needs at least 2 devices to measure the links."
        )
    if args.output:
        _writable(args.output)
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    if args.backend in ("jax", "xla") and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        # CPU-only machines: fake the devices (read when JAX first starts its backend)
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    from .compiler.api import compile as ap_compile

    topo, got = calibrate(args.backend, args.devices, ap_compile)
    for k, v in got.items():
        print(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}")
    path = args.output or cache_path(args.backend, args.devices)
    save(topo, path)
    print(
        f"saved {path}: {topo}"
        + ("" if args.output else " (plans on this machine without a topology use it)")
        + f"; autopar plan --topology {path} or ap.Topology.preset({str(path)!r}, devices) "
        "name it explicitly"
    )
    return 0


def _parser() -> argparse.ArgumentParser:
    """The command line's parser. Long because it is a table: one ``add_argument`` per option
    of every subcommand, each with its help, read top to bottom as ``autopar --help`` does."""
    from .config import OptimizerLevel, ParallelMode, PipelineScheduler, SearchMode

    values = lambda e: [m.value for m in e]
    parser = argparse.ArgumentParser(
        prog="autopar", description="autopar: auto-parallel compiler for JAX training steps."
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show the Python traceback of an error (before the command)",
    )
    parser.add_argument("--version", action="version", version=f"autopar {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "plan",
        help="plan a training step and save its strategy",
        description="Plan the step that MODULE:FUNCTION returns, without running "
        "it, print the estimate and save the strategy.",
    )
    p.add_argument(
        "target",
        metavar="MODULE:FUNCTION",
        help="a .py file or module and a function returning (step, args) or "
        "(step, args, options); options are ap.compile keywords",
    )
    p.add_argument("--devices", type=int, help="device count (default: the mesh's, else 1)")
    p.add_argument("--mesh", type=_mesh, help="logical mesh, e.g. 8 or 2x4")
    p.add_argument(
        "--mode",
        default="auto_parallel",
        choices=values(ParallelMode),
        help="parallel_mode (default auto_parallel)",
    )
    p.add_argument(
        "--topology",
        help="local, cluster:HOSTSxPER_HOST or a topology file "
        "written by autopar calibrate (default: this machine's "
        "calibration, measured on first use)",
    )
    p.add_argument("--max-memory", help="per-device memory cap, e.g. 16GB")
    p.add_argument(
        "--search",
        choices=values(SearchMode),
        help="auto_parallel's solver (default: dynamic_programming on meshes of up to "
        "two axes, recursive_programming on more)",
    )
    p.add_argument("--search-time", type=float, help="seconds the solver may take")
    p.add_argument(
        "--stages",
        type=_count_or_auto,
        default=1,
        help="pipeline stages, or auto: the planner chooses stages and micro-batches "
        "and the plan lists every pair it tried (default 1)",
    )
    p.add_argument(
        "--stage-devices",
        type=_stage_devices,
        help="devices per stage: auto (the planner chooses), equal, or counts, "
        "e.g. 1,3 (default: auto where the planner cuts the stages, equal for "
        "annotated ones)",
    )
    p.add_argument(
        "--micro-batches", type=_count_or_auto, default=1, help="micro-batches, or auto (default 1)"
    )
    p.add_argument(
        "--scheduler",
        default="1f1b",
        choices=values(PipelineScheduler),
        help="pipeline scheduler (default 1f1b)",
    )
    p.add_argument(
        "--optimizer-level",
        choices=values(OptimizerLevel),
        help="enable the parallel optimizer at this level",
    )
    p.add_argument(
        "-o",
        "--output",
        default="strategy.json",
        help="strategy file to write (default strategy.json)",
    )
    p.add_argument(
        "--format",
        choices=["autopar", "mindspore"],
        help="autopar's JSON (loadable) or MindSpore's strategy checkpoint (JSON "
        "for a .json name, else protobuf); default by the name: .json autopar's, "
        "any other (e.g. strategy.ckpt) MindSpore's protobuf",
    )
    p.set_defaults(run=_plan)

    p = sub.add_parser(
        "show",
        help="print a saved strategy as a table",
        description="Print a strategy file (autopar JSON) as the layout table, "
        "or (--top, --by) its costliest rows.",
    )
    p.add_argument("strategy", help="strategy file (autopar JSON)")
    p.add_argument(
        "--top", type=at_least(1, "rows"), help="only the N costliest rows (default 10 with --by)"
    )
    p.add_argument(
        "--by",
        choices=("operator", "module", "collective", "parameter"),
        help="summarise by operator (default with --top), source function "
        "(module), collective kind and mesh axes, or parameter",
    )
    p.set_defaults(run=_show)

    p = sub.add_parser(
        "report",
        help="write a self-contained HTML report of a strategy",
        description="Write an HTML page (no network needed) with the operator "
        "graph by layout and stage, a sortable operator table, the "
        "memory timeline against the cap and the communication by "
        "collective and mesh axis.",
    )
    p.add_argument("strategy", help="strategy file (autopar JSON)")
    p.add_argument("-o", "--output", default="report.html", help="HTML file (default report.html)")
    p.set_defaults(run=_report)

    p = sub.add_parser(
        "solve",
        help="solve an IOPDDL strategy-search problem",
        description="Solve an IOPDDL problem file within a time limit and print "
        "the chosen strategy indices last.",
    )
    p.add_argument("problem", help="problem file (.json or .json.gz, IOPDDL format)")
    p.add_argument("timeout", type=float, help="seconds for the whole run, reading included")
    p.add_argument(
        "--solver",
        default="best",
        help="best (default: local_search), ilp, dynamic_programming, "
        "sharding_propagation, local_search or brute_force",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object (cost, peak, lower_bound, gap, choice, ...) "
        "instead of the bare strategy list",
    )
    p.set_defaults(run=_solve)

    p = sub.add_parser(
        "calibrate",
        help="measure this machine again for the cost model",
        description="Time small steps on the backend with every device busy "
        "(per-call overhead, host transfer, matmul FLOP/s, all-reduce "
        "launch and bandwidth; elementwise bandwidth in-process) and "
        "save them as this machine's topology, which plans without "
        "one use (compile measures it on first use).",
    )
    p.add_argument(
        "--backend",
        choices=("native", "jax", "xla"),
        default="native",
        help="the runtime to measure (default native)",
    )
    p.add_argument("--devices", type=int, default=2, help="devices (default 2)")
    p.add_argument("-o", "--output", help="write a topology file here instead of the cache")
    p.set_defaults(run=_calibrate)

    p = sub.add_parser(
        "launch",
        help="run a script as the processes of a multi-process JAX job",
        description="Start this host's processes of a multi-process JAX job "
        "(like torchrun): each runs SCRIPT with its place in the "
        "environment ap.init_distributed() reads, its output prefixed "
        "with its rank; the first process to fail stops the others "
        "and sets the exit status.",
    )
    p.add_argument("--nprocs", type=int, default=1, help="processes on this host (default 1)")
    p.add_argument(
        "--devices-per-process",
        type=int,
        metavar="K",
        help="devices of each process: K host devices on CPU, K GPUs on a GPU host "
        "(default: JAX's)",
    )
    p.add_argument("--nnodes", type=int, default=1, help="hosts in the job (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this host's index (default 0)")
    p.add_argument(
        "--coordinator",
        metavar="HOST:PORT",
        help="node 0's address for JAX's coordinator (needed with --nnodes > 1; "
        "default: a free port on this host)",
    )
    p.add_argument(
        "command",
        nargs=argparse.REMAINDER,
        metavar="SCRIPT [ARGS ...]",
        help="the script and its arguments, or -m MODULE [ARGS ...]",
    )
    p.set_defaults(run=_launch)

    p = sub.add_parser(
        "bench",
        help="benchmark the native collectives",
        add_help=False,
        description="Run autopar.tools.bench; every argument is passed on "
        "(autopar bench --help lists them).",
    )
    p.add_argument("options", nargs=argparse.REMAINDER, help="autopar bench --help lists them")
    return parser


def _version() -> str:
    """The installed distribution's version (no JAX imported), or how it is missing."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("autopar")
    except PackageNotFoundError:
        return "(not installed: run pip install . from the repository root)"


def main(argv=None) -> int:
    own_process = argv is None  # the command line started this process
    argv = sys.argv[1:] if own_process else list(argv)
    if argv[:1] == ["bench"]:  # every option, --help included, is bench's
        from .tools import bench

        try:
            return bench.main(argv[1:], prog="autopar bench")
        except Exception as e:  # noqa: BLE001 -- as every other command's errors
            return _failed(e, "--debug" in argv)
    if "launch" in argv and "-m" in argv[argv.index("launch") :] and "--" not in argv:
        at = argv.index("-m", argv.index("launch"))  # argparse takes -m for an option of
        argv = argv[:at] + ["--"] + argv[at:]  # its own: the command starts there
    args = _parser().parse_args(argv)
    args.own_process = own_process
    try:
        return args.run(args)
    except Exception as e:  # noqa: BLE001 -- every error ends here, as one line or a report
        return _failed(e, args.debug)
    except KeyboardInterrupt:
        print("autopar: interrupted", file=sys.stderr)
        return 130


def _failed(e: Exception, debug: bool) -> int:
    """Report an error that ended a command; its exit status. A user's error (an autopar
    error, a file that cannot be read or written, memory) is one line and exit status 2;
    anything else is a bug in autopar: its traceback and a request to report it, status 1.
    ``--debug`` adds the traceback to either."""
    import traceback

    user = isinstance(e, (AutoparError, OSError, MemoryError, RecursionError))
    if debug or not user:
        traceback.print_exception(e, file=sys.stderr)
    if not user:
        print(
            f"autopar: internal error {type(e).__name__}: {e}. This is a bug in autopar; "
            "please report it with the command line and the traceback above.",
            file=sys.stderr,
        )
        return 1
    if isinstance(e, OSError):
        text = f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    elif isinstance(e, MemoryError):
        text = "out of memory; give a smaller problem or more memory"
    elif isinstance(e, RecursionError):
        text = "input nested too deeply"
    else:
        text = str(e)
    line = " ".join(text.split())
    hint = " (--debug shows the traceback)" if isinstance(e, UserCodeError) and not debug else ""
    print(f"autopar: {line}{hint}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
