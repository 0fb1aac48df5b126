"""examples.llama.sweep: the grid, resuming it, and the report's choice of best settings."""

import json
import os

import pytest

from examples.llama import sweep

STUDIES = os.path.join(os.path.dirname(__file__), os.pardir, "examples", "llama", "studies")
GPU = os.path.join(STUDIES, "gpu60m.toml")


def _small(config: dict) -> dict:
    """`config` with its optimizers and settings, each at its first learning rate, on a tiny
    model for two steps (the first, which compiles, is not timed), one evaluation."""
    config["grid"].update(seq_len=[16], steps=[2])
    for settings in config["optimizers"].values():
        if isinstance(settings.get("lr"), list):
            settings["lr"] = settings["lr"][:1]
    config["train"].update(model=["num_layers=1", "hidden_size=32", "intermediate_size=64", "num_heads=2"],
                           batch_size=2, eval_every=2, eval_batches=1)  # fmt: skip
    return config


@pytest.mark.slow
@pytest.mark.long
def test_the_gpu_study_runs_small_then_resumes_without_rerunning(tmp_path, monkeypatch):
    """The GPU study's config as it stands (its optimizers and settings) on a tiny model: every
    run finishes and is recorded, the report ranks them, and a second call trains nothing."""
    config = _small(sweep.load_config(GPU))
    out, runs = str(tmp_path / "gpu60m.jsonl"), str(tmp_path / "runs")
    sweep.run_grid(config, out, runs, log=lambda _: None)
    records = sweep.load_records(out)
    assert sorted(r["name"] for r in records) == sorted(config["optimizers"])
    for r in records:
        assert r["val_curve"][-1]["step"] == r["flags"]["steps"] == 2
        assert r["final_val_loss"] == r["val_curve"][-1]["val_loss"] > 0
        assert r["tokens_per_s"] > 0 and r["wall_s"] > 0 and r["command"].startswith("python -m examples.llama.train")
        assert not os.path.exists(os.path.join(r["run_dir"], "checkpoints"))  # keep_checkpoints = false
    by_name = {r["name"]: r for r in records}
    adamw, gwt = by_name["adamw-modular-tuned"], by_name["gwt-2"]
    assert gwt["matrix_state_bytes"] < adamw["matrix_state_bytes"] == adamw["adamw_matrix_state_bytes"]
    sweep.write_report(out, plots=False)
    report = (tmp_path / "gpu60m-report" / "report.md").read_text()
    assert all(report.count(f"| {name} |") == 1 for name in config["optimizers"])

    def no_training(args):
        raise AssertionError("a finished run was trained again")

    monkeypatch.setattr("examples.llama.train.run", no_training)
    assert sweep.run_grid(config, out, runs, log=lambda _: None) == []
    assert len(sweep.load_records(out)) == len(config["optimizers"])


def test_plot_styles_tell_every_optimizer_apart():
    names = [f"opt-{i}" for i in range(25)]
    styles = sweep.plot_styles(names)
    assert len({(s["color"], s["marker"]) for s in styles.values()}) == len(names)


def test_expand_axes_overrides_and_token_budget():
    config = {
        "grid": {"seed": [0, 1], "seq_len": [64, 128], "steps": [10]},
        "train": {"model": ["num_layers=1"], "tokens_per_step": 1024},
        "optimizers": {
            "adamw": {"lr": [1e-3, 1e-2]},
            "gwt-3": {"optimizer": "gwt", "level": 3, "model": [["num_layers=2"]]},
        },
    }
    runs = sweep.expand(config)
    assert len(runs) == 2 * 2 * 2 + 2 * 2
    assert [r["flags"]["seed"] for r in runs] == [0] * 6 + [1] * 6  # seeds outermost
    assert {(r["flags"]["seq_len"], r["flags"]["batch_size"]) for r in runs} == {(64, 16), (128, 8)}
    gwt = [r for r in runs if r["name"] == "gwt-3"]
    assert all(r["flags"]["optimizer"] == "gwt" and r["flags"]["model"] == ["num_layers=2"] for r in gwt)
    assert len({sweep.run_key(r) for r in runs}) == len(runs)
    with pytest.raises(SystemExit, match="unknown train flags"):
        sweep.expand({"optimizers": {"adamw": {"learning_rate": [1.0]}}})


def _record(name, lr, seed, loss, alpha=0.25, steps=100):
    flags = {"optimizer": name, "lr": lr, "alpha": alpha, "seed": seed, "seq_len": 64, "batch_size": 8, "steps": steps}
    curve = [
        {"step": steps // 2, "tokens": steps // 2 * 512, "val_loss": None if loss is None else loss + 0.5},
        {"step": steps, "tokens": steps * 512, "val_loss": loss},
    ]
    return {
        "key": json.dumps([name, flags]),
        "name": name,
        "flags": flags,
        "final_val_loss": loss,
        "val_curve": curve,
        "state_bytes": 100,
        "matrix_state_bytes": 50,
        "adamw_matrix_state_bytes": 100,
        "tokens_per_s": 1000.0,
    }


def test_report_best_setting_spread_and_edge_flag(tmp_path):
    records = []
    for seed, noise in enumerate((0.0, 0.02, -0.02)):
        # adamw: best lr 1e-2 inside its grid; gwt: best at the largest lr (edge), one lr diverged.
        records += [_record("adamw", lr, seed, loss + noise) for lr, loss in ((1e-3, 3.0), (1e-2, 2.5), (1e-1, 2.8))]
        records += [_record("gwt", lr, seed, loss + noise) for lr, loss in ((1e-3, 3.2), (1e-2, 2.6))]
        records.append(_record("gwt", 1e-1, seed, None if seed == 0 else 2.0))
    records.append({**_record("gwt", 1e-2, 0, 9.0), "error": "an interrupted run"})  # ignored
    best = sweep.best_settings(records)
    ((task, names),) = best.items()
    assert names["adamw"]["flags"]["lr"] == 1e-2 and names["adamw"]["edges"] == []
    assert (
        names["adamw"]["mean"] == pytest.approx(2.5)
        and names["adamw"]["std"] == pytest.approx(0.02)
        and names["adamw"]["n"] == 3
    )
    # gwt's lr 1e-1 diverged on one seed: its mean is inf, so 1e-2 wins, inside the grid (a larger lr was tried).
    assert names["gwt"]["flags"]["lr"] == 1e-2 and names["gwt"]["edges"] == []
    records = [
        r for r in records if not (r["name"] == "gwt" and r["flags"]["lr"] == 1e-1 and r["final_val_loss"] is None)
    ]
    records.append(_record("gwt", 1e-1, 0, 2.0))
    best = sweep.best_settings(records)[task]
    assert best["gwt"]["flags"]["lr"] == 1e-1 and best["gwt"]["edges"] == ["lr at the high edge"]
    # A setting with fewer seeds (here one, lucky) is not a candidate, but counts for the grid's edges.
    best = sweep.best_settings(records + [_record("adamw", 3e-1, 0, 1.0)])[task]
    assert best["adamw"]["flags"]["lr"] == 1e-2 and best["adamw"]["edges"] == []
    best = sweep.best_settings(records)[task]
    agreement = sweep.ranking_agreement({task: best})[task]
    assert agreement["final"] == ["gwt", "adamw"] and agreement["agree"]
    path = tmp_path / "study.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"cut sh')  # a line cut short is skipped
    text = sweep.write_report(str(path), plots=False)
    assert "lr at the high edge" in text and "| adamw | 0.01 |" in text and "Across tasks" not in text
    # Another study's runs of another task join the report; --only keeps the named optimizers.
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps(_record("adamw", 1e-2, seed, 2.0, steps=200)) + "\n" for seed in range(3)))
    text = sweep.write_report(str(path), str(tmp_path / "both"), plots=False, include=[str(other)], only=["adamw"])
    assert "| gwt |" not in text and "## Across tasks" in text
    assert "| adamw | 2.5000 ± 0.0200 (3) | 2.0000 ± 0.0000 (3) |" in text


@pytest.mark.parametrize("name", sorted(f[: -len(".toml")] for f in os.listdir(STUDIES) if f.endswith(".toml")))
def test_study_configs_expand(name):
    config = sweep.load_config(os.path.join(STUDIES, f"{name}.toml"))
    runs = sweep.expand(config)
    assert runs and len({sweep.run_key(r) for r in runs}) == len(runs)
    seeds = {r["flags"]["seed"] for r in runs} | set(config["study"].get("confirm_seeds", []))
    assert name != "default" or seeds == {0, 1, 2}  # the ranking study: 3 seeds


def test_confirmation_seeds_repeat_the_best_tuned_setting(tmp_path, monkeypatch):
    config = {
        "study": {"name": "t", "confirm_seeds": [1, 2]},
        "grid": {"seed": [0], "steps": [10]},
        "optimizers": {"adamw": {"lr": [1e-3, 1e-2, 1e-1]}, "gwt": {"lr": [1e-2, 1e-1]}},
    }
    out, trained = str(tmp_path / "t.jsonl"), []
    loss = {("adamw", 1e-3): 3.0, ("adamw", 1e-2): 2.0, ("adamw", 1e-1): None, ("gwt", 1e-2): 2.5, ("gwt", 1e-1): 2.4}

    def fake_run(study, run, actions):  # a deterministic stand-in for training
        trained.append((run["name"], run["flags"]["lr"], run["flags"]["seed"]))
        final = loss[run["name"], run["flags"]["lr"]]
        final = None if final is None else final + 0.01 * run["flags"]["seed"]
        return {
            "key": sweep.run_key(run),
            "name": run["name"],
            "flags": run["flags"],
            "final_val_loss": final,
            "val_curve": [],
            "wall_s": 1.0,
        }

    monkeypatch.setattr(sweep, "run_one", fake_run)
    assert sweep.confirmation_runs(config, []) == []  # nothing tuned yet
    sweep.run_grid(config, out, str(tmp_path / "runs"), only=["adamw"], log=lambda _: None)
    # adamw's grid, then its best (lr 1e-2; the diverged 1e-1 is not) on seeds 1 and 2; gwt not run (--only)
    assert trained == [
        ("adamw", 1e-3, 0),
        ("adamw", 1e-2, 0),
        ("adamw", 1e-1, 0),
        ("adamw", 1e-2, 1),
        ("adamw", 1e-2, 2),
    ]
    trained.clear()
    sweep.run_grid(config, out, str(tmp_path / "runs"), log=lambda _: None)
    assert trained == [("gwt", 1e-2, 0), ("gwt", 1e-1, 0), ("gwt", 1e-1, 1), ("gwt", 1e-1, 2)]
    trained.clear()
    assert sweep.run_grid(config, out, str(tmp_path / "runs"), log=lambda _: None) == [] and trained == []
    best = sweep.best_settings(sweep.load_records(out))
    # only the three-seed settings are candidates
    assert {n: (b["flags"]["lr"], b["n"]) for n, b in next(iter(best.values())).items()} == {
        "adamw": (1e-2, 3),
        "gwt": (1e-1, 3),
    }


def test_report_block_in_a_readme(tmp_path):
    records = [
        _record("adamw", lr, seed, loss) for seed in range(3) for lr, loss in ((1e-3, 3.0), (1e-2, 2.5), (1e-1, 2.8))
    ]
    (tmp_path / "s.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    config = tmp_path / "s.toml"
    config.write_text(f'[study]\nname = "s"\noutput = "{tmp_path / "s.jsonl"}"\n')
    readme = tmp_path / "README.md"
    start, end = sweep.readme_markers(str(tmp_path / "s-report"))
    readme.write_text(f"# Title\n\nbefore\n{start}\nold\n{end}\nafter\n")
    sweep.main(["--config", str(config), "--report", "--readme", str(readme)])
    text = readme.read_text()
    assert "old" not in text and text.startswith("# Title\n\nbefore\n") and text.endswith(f"{end}\nafter\n")
    block = text.split(start)[1].split(end)[0]
    assert "python -m examples.llama.sweep --config" in block and "--report --readme" in block
    assert "#### 9m seq 64 x 8, 100 steps" in block and "| adamw | 0.01 |" in block
    assert "](s-report/9m-seq-64-x-8-100-steps-steps.png)" in block  # images found from the README
    with pytest.raises(SystemExit, match="no block"):
        sweep.main(["--config", str(config), "--report", "--readme", str(tmp_path / "s.toml")])


def test_ranking_agreement_and_rank_correlation():
    def rec(name, half, final):
        r = _record(name, 1e-2, 0, final)
        r["val_curve"][0]["val_loss"] = half
        return r

    same = sweep.best_settings([rec("a", 3.0, 2.0), rec("b", 3.1, 2.1), rec("c", 3.2, 2.2)])
    (a,) = sweep.ranking_agreement(same).values()
    assert a["agree"] and a["spearman"] == pytest.approx(1.0)
    reversed_ = sweep.best_settings([rec("a", 3.2, 2.0), rec("b", 3.1, 2.1), rec("c", 3.0, 2.2)])
    (a,) = sweep.ranking_agreement(reversed_).values()
    assert not a["agree"] and a["half"] == ["c", "b", "a"] and a["spearman"] == pytest.approx(-1.0)
    (a,) = sweep.ranking_agreement(sweep.best_settings([rec("a", 3.2, 2.0), rec("b", 3.1, 2.1)])).values()
    assert not a["agree"] and a["spearman"] == pytest.approx(-1.0)  # two optimizers, swapped
