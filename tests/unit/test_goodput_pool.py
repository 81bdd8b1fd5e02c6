"""bench/goodput_pool.py: the rounds of several goodput runs pooled per variant, the kills listed per run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(name: str, ours: list[float], code: str) -> dict:
    return {"code": {"commit": code, "tree_digest": code + "x"},
            "summary": {"none": {"ratio_to_none_median": 1.0, "ratio_to_none_per_round": [1.0] * len(ours)},
                        "ours": {"ratio_to_none_median": sorted(ours)[len(ours) // 2], "ratio_to_none_per_round": ours},
                        "skipped_one": {"skipped": "no tier 0"},
                        "kills": {"ours": {"steps_lost": 1, "kill_to_first_step_s": 1.5}},
                        "targets": {"ours ratio >= 0.99": True}}}


def test_rounds_of_the_chosen_runs_are_pooled(tmp_path: Path) -> None:
    files = []
    for name, ours, code in (("a", [0.995, 0.98, 0.991], "c1"), ("b", [0.97, 0.999], "c1"), ("c", [0.5], "old")):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(run(name, ours, code)))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_pool.py"), *map(str, files), "--code", "c1"],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    pooled = json.loads(out)
    ours = pooled["variants"]["ours"]
    assert ours["rounds"] == 5 and ours["pooled_median"] == 0.991  # of 0.97, 0.98, 0.991, 0.995, 0.999
    assert ours["rounds_at_or_over_0.99"] == 3 and ours["runs_at_or_over"] == 2  # medians a 0.991, b 0.999
    assert "skipped_one" not in pooled["variants"]
    assert [k["run"] for k in pooled["kills"]["ours"]] == ["a.json", "b.json"]  # c is other code


def test_no_run_left_is_an_error_naming_the_flag(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    path.write_text(json.dumps(run("a", [0.99], "c1")))
    done = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_pool.py"), str(path), "--code", "zzz"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--code" in done.stderr


def test_renames_pool_a_setting_that_ran_under_two_names_and_can_swap_them(tmp_path: Path) -> None:
    # In run "a" the default was the setting now named "ours_alt", and "ours_old" was today's default "ours".
    a = run("a", [0.97, 0.975], "c1")
    a["summary"]["ours_old"] = {"ratio_to_none_median": 0.99, "ratio_to_none_per_round": [0.99, 0.995]}
    (tmp_path / "run_a.json").write_text(json.dumps(a))
    (tmp_path / "run_b.json").write_text(json.dumps(run("b", [0.993], "c1")))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_pool.py"), str(tmp_path / "run_a.json"),
                          str(tmp_path / "run_b.json"), "--rename", "run_a:ours=ours_alt",
                          "--rename", "run_a:ours_old=ours"], capture_output=True, text=True, timeout=60, check=True)
    pooled = json.loads(out.stdout)["variants"]
    assert pooled["ours"]["rounds"] == 3 and pooled["ours"]["pooled_median"] == 0.993  # 0.99, 0.995 from a; b
    assert pooled["ours_alt"]["run_medians"] == {"run_a.json": 0.975} and "ours_old" not in pooled
    assert [k["run"] for k in json.loads(out.stdout)["kills"]["ours_alt"]] == ["run_a.json"]
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_pool.py"), str(tmp_path / "run_a.json"),
                          "--rename", "ours=ours_alt"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--rename 'ours=ours_alt': expected FILE:OLD=NEW" in bad.stderr


def test_pair_sets_two_variants_side_by_side_round_by_round_with_their_slow_steps(tmp_path: Path) -> None:
    def ran(*rounds: list[float]) -> dict:
        return {"rounds": [{"raw": {"step_s": steps}} for steps in rounds]}

    even = [0.1] * 9
    a = run("a", [0.98, 0.99], "c1")
    a["summary"]["alt"] = {"ratio_to_none_median": 0.99, "ratio_to_none_per_round": [0.985, 0.999]}
    # "alt" ran a third round that time ran out for before `none` ran it: no pair, its steps left out.
    a["variants"] = {"ours": ran(even + [0.11], even + [0.104, 0.1029]), "alt": ran(even, even, even + [9.0])}
    b = run("b", [0.97], "c1")  # no "alt": not paired
    files = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, result in zip(files, (a, b), strict=True):
        path.write_text(json.dumps(result))
    out = subprocess.run([sys.executable, str(REPO / "bench" / "goodput_pool.py"), *map(str, files),
                          "--pair", "ours", "alt"], capture_output=True, text=True, timeout=60, check=True).stdout
    pooled = json.loads(out)
    (pair,) = pooled["pairs"]
    assert pair["b_minus_a_per_run"] == {"a.json": [0.005, 0.009]} and pair["rounds"] == 2
    assert pair["median"] == 0.007 and pair["rounds_b_ahead"] == 2
    # ours: 10 ms over in round 0, 4 ms in round 1 (2.9 ms is under SLOW_OVER); alt: none in its paired rounds
    assert pair["slow_steps_per_round"] == {"ours": 1.0, "alt": 0.0}
    assert pair["slow_ms_per_round"] == {"ours": 7.0, "alt": 0.0}
    assert pooled["variants"]["ours"]["rounds_with_step_times"] == 2  # run b kept no step times
    assert pooled["variants"]["alt"]["slow_steps_per_round"] == 0.0
