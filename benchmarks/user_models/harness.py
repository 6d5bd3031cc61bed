"""Auto_parallel against data_parallel on models written the way users write them (an outside
check of plan quality, kept apart from the models the planner was tuned on): the shared harness.

Each ``m*.py`` here defines a step ``step(params, opt_state, batch)`` and calls ``bench``: the
plain ``jax.jit`` step once for reference, both modes compiled on the native runtime with 2
devices, their results after 2 steps against the reference, then ``rounds`` rounds timing each
mode in turn (3 warm-up steps, the median of 20, a training loop reading the loss each step).
Out: a JSON summary line, and under ``$AUTOPAR_BENCH_OUT`` (default ./user_models_out) each
mode's strategy table and the whole result. Run one at a time: ``python
benchmarks/user_models/m1_gpt_flax.py [ROUNDS]`` (``GPT_BIG=1`` for the 4-layer GPT),
``m2_mlp_eqx.py``, ``m3_cnn_flax.py``, ``m4_moe.py``, ``m5_bigmlp.py ROUNDS adam|sgd``.
"""
import os, sys, time, json, statistics
os.environ.setdefault("JAX_PLATFORMS", "cpu")
REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path.insert(0, REPO)
OUT_DIR = os.environ.get("AUTOPAR_BENCH_OUT", os.path.join(os.getcwd(), "user_models_out"))
os.makedirs(OUT_DIR, exist_ok=True)
import numpy as np
import jax, jax.numpy as jnp
import autopar as ap
print("autopar from", ap.__file__, flush=True)


def children_cpu():
    """Total cpu ticks of all descendant processes of this one (to check idle workers)."""
    me = os.getpid()
    tot = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            st = open(f"/proc/{pid}/stat").read()
            fields = st.rsplit(")", 1)[1].split()
            ppid = int(fields[1])
            # descendants: walk up
            p = int(pid); ok = False
            for _ in range(10):
                if p == me:
                    ok = True; break
                s = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                p = int(s[1])
                if p <= 1: break
            if ok and int(pid) != me:
                tot += int(fields[11]) + int(fields[12])
        except Exception:
            pass
    return tot


def tree_maxrel(a, b):
    """Per leaf: max|x-y| / max|y| (leaf-scaled relative error); ok if <= 1e-4 for every leaf.
    Also counts leaves failing elementwise np.allclose(rtol=1e-4, atol=1e-7)."""
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    assert len(la) == len(lb)
    worst = 0.0; nelem_fail = 0
    for x, y in zip(la, lb):
        x = np.asarray(x, np.float64); y = np.asarray(y, np.float64)
        assert x.shape == y.shape, (x.shape, y.shape)
        if x.size == 0: continue
        rel = float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12))
        worst = max(worst, rel)
        if not np.allclose(x, y, rtol=1e-4, atol=1e-7):
            nelem_fail += 1
    return worst <= 1e-4, worst, nelem_fail


def time_steps(fn, params, opt_state, batch, warm=3, n=20):
    for _ in range(warm):
        loss, params, opt_state = fn(params, opt_state, batch)
        float(loss)
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        loss, params, opt_state = fn(params, opt_state, batch)
        float(loss)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3, params, opt_state


def bench(name, step, params, opt_state, batch, rounds=5, batch_argnums=(2,), extra_cfg=None):
    out = {"model": name}
    extra_cfg = extra_cfg or {}
    nparams = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
    out["n_params"] = nparams
    print(f"== {name}: {nparams/1e6:.3f} M params", flush=True)

    # single device reference
    jstep = jax.jit(step)
    p, o = params, opt_state
    ref_losses = []
    for _ in range(2):
        l, p, o = jstep(p, o, batch)
        ref_losses.append(float(l))
    ref = (p, o)
    jit_ms, _, _ = time_steps(jstep, params, opt_state, batch)
    out["jit_ms_main_process"] = jit_ms
    print(f"jax.jit single process: {jit_ms:.2f} ms, ref losses {ref_losses}", flush=True)

    comps = {}
    modes = ["data_parallel", "auto_parallel"]
    for m in modes:
        cfg = ap.ParallelConfig(parallel_mode=m, device_num=2, **extra_cfg)
        t0 = time.perf_counter()
        comps[m] = ap.compile(step, params, opt_state, batch, config=cfg, batch_argnums=batch_argnums)
        print(f"compiled {m} in {time.perf_counter()-t0:.1f}s timings={comps[m].timings}", flush=True)
    try:
        table = comps["auto_parallel"].strategy.table()
        with open(f"{OUT_DIR}/{name}_auto_table.txt", "w") as f:
            f.write(table)
        with open(f"{OUT_DIR}/{name}_dp_table.txt", "w") as f:
            f.write(comps["data_parallel"].strategy.table())
        out["auto_table_head"] = "\n".join(table.splitlines()[:6])
        out["dp_table_head"] = "\n".join(comps["data_parallel"].strategy.table().splitlines()[:3])
        print("AUTO:\n" + out["auto_table_head"], flush=True)
        print("DP:\n" + out["dp_table_head"], flush=True)
        out["auto_collectives"] = [str(c) for c in comps["auto_parallel"].collectives()][:40]
        out["dp_ncollectives"] = len(comps["data_parallel"].collectives())

        # correctness: 2 steps
        for m in modes:
            p, o = params, opt_state
            losses = []
            for _ in range(2):
                l, p, o = comps[m](p, o, batch)
                losses.append(float(l))
            okl = np.allclose(losses, ref_losses, rtol=1e-4, atol=1e-6)
            okp, worst, nfail = tree_maxrel((p, o), ref)
            out[f"{m}_match"] = bool(okl and okp)
            out[f"{m}_leaves_failing_elementwise"] = nfail
            out[f"{m}_losses"] = losses
            out[f"{m}_maxrel"] = worst
            print(f"{m}: losses {losses} match_loss={okl} match_state={okp} leafscaled_maxrel={worst:.2e} leaves_failing_elementwise={nfail}/{len(jax.tree.leaves(ref))}", flush=True)

        # idle worker check
        c0 = children_cpu(); time.sleep(2.0); c1 = children_cpu()
        out["idle_child_ticks_2s"] = c1 - c0
        print(f"idle child cpu ticks over 2s: {c1-c0}", flush=True)

        res = {m: [] for m in modes}
        ratios = []
        for r in range(rounds):
            for m in modes:
                ms, _, _ = time_steps(comps[m], params, opt_state, batch)
                res[m].append(ms)
            ratios.append(res["auto_parallel"][-1] / res["data_parallel"][-1])
            print(f"round {r}: dp {res['data_parallel'][-1]:.2f} ms  auto {res['auto_parallel'][-1]:.2f} ms  ratio {ratios[-1]:.3f}", flush=True)
        out["dp_ms"] = res["data_parallel"]; out["auto_ms"] = res["auto_parallel"]; out["ratios"] = ratios
        out["summary"] = dict(dp_ms=statistics.median(res["data_parallel"]),
                              auto_ms=statistics.median(res["auto_parallel"]),
                              ratio_median=statistics.median(ratios), ratio_min=min(ratios), ratio_max=max(ratios))
        print("SUMMARY", json.dumps(out["summary"]), flush=True)
    finally:
        for c in comps.values():
            c.close()
    with open(f"{OUT_DIR}/{name}_result.json", "w") as f:
        json.dump(out, f, indent=1)
    return out
