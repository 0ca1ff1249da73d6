"""The accuracy check of ``attention_c.bench.peers``: every library's
outputs against SDPA's in float64, before any timing."""

import importlib.util
import math
import os

import numpy as np

from attention_c.bench import harness
from attention_c.bench.peers_cases import (MODULES, TOLERANCE_32,
                                           TOLERANCE_64, check_cases)
from attention_c.bench.peers_child import compute_outputs, run_worker


def installed(lib):
    """Whether every module ``lib`` needs can be found (not imported)."""
    return all(importlib.util.find_spec(m) is not None for m in MODULES[lib])


def compare(found, reference):
    """{implementation: {'dtype', 'errors': {case key/array: error},
    'ok'}} of outputs ``found`` against SDPA's float64 ``reference``
    ({case key: outputs}); an implementation passes when every array of
    every case is within the tolerance of its dtype."""
    verdicts = {}
    for (name, dtype, key), arrays in found.items():
        tolerance = TOLERANCE_64 if dtype == "float64" else TOLERANCE_32
        v = verdicts.setdefault(f"{name} {dtype}", {
            "impl": name, "dtype": dtype, "tolerance": tolerance,
            "errors": {}, "ok": True})
        for array, x in arrays.items():
            exact = reference[key][array]
            err = (harness.errors({array: x}, {array: exact})[array]
                   if x.shape == exact.shape else math.inf)
            v["errors"][f"{key} {array}"] = err
            v["ok"] = v["ok"] and err <= tolerance
    return verdicts


def load_outputs(path):
    """The outputs an .npz of a check child holds."""
    found = {}
    with np.load(path) as data:
        for name in data.files:
            impl, dtype, key, array = name.split("|")
            found.setdefault((impl, dtype, key), {})[array] = data[name]
    return found


def check_lib(lib, reference, seed, threads, folder, compute=None):
    """Check ``lib`` against SDPA in float64 (``reference``); returns
    (version, {implementation: passed}, verdicts, error or None).  The
    outputs come from the library's child process; ``compute`` (tests
    only, see ``compute_outputs``) computes them in this process
    instead."""
    cases = check_cases()
    if compute is not None:
        found, version = compute_outputs(lib, cases, seed, threads,
                                         compute), "test"
    else:
        out = os.path.join(folder, f"check-{lib}.npz")
        child = run_worker(lib, {"mode": "check", "threads": threads,
                                 "cases": cases, "seed": seed, "out": out})
        if "error" in child:
            return None, {}, {}, child["error"]
        found, version = load_outputs(out), child["version"]
    verdicts = compare(found, reference)
    passed = {}
    for v in verdicts.values():
        passed[v["impl"]] = passed.get(v["impl"], True) and v["ok"]
    return version, passed, verdicts, None


def sdpa_reference(seed, threads, folder):
    """SDPA's float64 outputs on the check cases ({case key: outputs}),
    SDPA's version and its check's error (None when it ran)."""
    out = os.path.join(folder, "check-sdpa.npz")
    child = run_worker("sdpa", {"mode": "check", "threads": threads,
                                "cases": check_cases(), "seed": seed,
                                "out": out})
    if "error" in child:
        return None, None, child["error"]
    found = load_outputs(out)
    return ({key: x for (name, dtype, key), x in found.items()
             if dtype == "float64"}, child["version"], None)
