"""training.png at the end of a run, and `cnns plot` overlaying runs, from hand-written CSV files."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from cnns.cli.plot import plot_main
from cnns.errors import CnnsError
from cnns.runfolder.log import TRAINING_COLUMNS, VALIDATION_COLUMNS
from cnns.runfolder.plots import build_figure, plot_training, read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _training_row(iteration: int, scale: float = 1.0) -> dict:
    return {"step": iteration // 10, "iteration": iteration, "epoch": iteration / 100, "lr": 0.1 * scale,
            "loss_batch": 2.0 / (1 + iteration) * scale, "loss_avg": 2.3 - iteration / 100 * scale,
            "train_acc_batch": 10 + iteration / 5, "train_acc_avg": 10 + iteration / 5 * scale, "it_time": 0.1,
            "img_per_sec": 1000 + iteration * scale, "total_time": iteration / 10}


def _validation_row(name: str, iteration: int, acc: float) -> dict:
    return {"name": name, "iteration": iteration, "epoch": iteration / 100, "val_acc": acc, "raw_acc": acc,
            "val_time": 1.0, "val_size": 1000, "img_per_sec": 5000, "latency": 1.5, "val_top5": acc + 5}


def _write_csv(path: Path, columns: tuple[str, ...], rows: list[dict], extra_lines: str = "") -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
        f.write(extra_lines)


def make_run(folder: Path, scale: float = 1.0) -> Path:
    folder.mkdir(parents=True)
    _write_csv(folder / "training.csv", TRAINING_COLUMNS, [_training_row(i, scale) for i in range(10, 110, 10)],
               extra_lines="garbage,not,a,number\n")
    _write_csv(folder / "validation.csv", VALIDATION_COLUMNS, [
        _validation_row("ckpt-50", 50, 30.0 * scale),
        _validation_row("ckpt-50_ema", 50, 31.0),
        _validation_row("ckpt-100", 100, 40.0 * scale),
        _validation_row("ckpt-100_ema", 100, 41.0),
        _validation_row("weight_avg_exp_0.97_last5", -1, 42.0),
        _validation_row("weight_avg_mean", 100, 42.5),
    ], extra_lines="ckpt-150,oops,,,\n")
    return folder


def _check_png(path: Path) -> None:
    from matplotlib.image import imread

    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = imread(path)
    height, width = image.shape[:2]
    assert height > 300 and width > 300


def test_read_run_keeps_plain_checkpoints(tmp_path):
    run = read_run(make_run(tmp_path / "RN20_bs32_ABC"))
    assert run.name == "RN20_bs32_ABC"
    assert run.iteration == [float(i) for i in range(10, 110, 10)]
    assert len(run.loss_avg) == len(run.train_acc_avg) == len(run.lr) == len(run.img_per_sec) == 10
    assert run.val_name == ["ckpt-50", "ckpt-100"]
    assert run.val_iteration == [50.0, 100.0]
    assert run.val_acc == [30.0, 40.0]


def test_read_run_without_validation_csv(tmp_path):
    folder = make_run(tmp_path / "run")
    (folder / "validation.csv").unlink()
    run = read_run(folder)
    assert run.val_iteration == [] and len(run.iteration) == 10


def test_plot_training_writes_png(tmp_path):
    folder = make_run(tmp_path / "run")
    out = plot_training(folder)
    assert out == folder / "training.png"
    _check_png(out)
    assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_figure_has_four_labelled_panels(tmp_path):
    fig = build_figure([read_run(make_run(tmp_path / "run"))])
    assert len(fig.axes) == 4
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["loss", "top-1 accuracy (%)", "learning rate", "throughput (images/s)"]
    assert [ax.get_xlabel() for ax in fig.axes] == ["iteration"] * 4
    assert [ax.get_ylabel() for ax in fig.axes] == ["loss", "top-1 accuracy (%)", "learning rate", "images/s"]
    accuracy = fig.axes[1]
    markers = [line for line in accuracy.get_lines() if line.get_label() == "validation"]
    assert len(markers) == 1
    assert markers[0].get_linestyle() == "None" and markers[0].get_marker() == "o"
    assert list(markers[0].get_xdata()) == [50.0, 100.0]
    assert list(markers[0].get_ydata()) == [30.0, 40.0]


def test_plot_main_overlays_two_runs(tmp_path, monkeypatch, capsys):
    a = make_run(tmp_path / "RN20_a")
    b = make_run(tmp_path / "RN20_b", scale=0.5)
    monkeypatch.chdir(tmp_path)
    assert plot_main([str(a), str(b)]) == 0
    out = tmp_path / "comparison.png"
    _check_png(out)
    assert f"Wrote {Path('comparison.png')}" in capsys.readouterr().out

    fig = build_figure([read_run(a), read_run(b)])
    for ax in fig.axes:
        runs_lines = [line for line in ax.get_lines() if line.get_linestyle() != "None"]
        assert [line.get_label() for line in runs_lines] == ["RN20_a", "RN20_b"]
        assert runs_lines[0].get_color() != runs_lines[1].get_color()
    legend_texts = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend_texts == ["RN20_a", "RN20_b"]
    accuracy_legend = [t.get_text() for t in fig.axes[1].get_legend().get_texts()]
    assert "RN20_a validation" in accuracy_legend and "RN20_b validation" in accuracy_legend


def test_plot_main_single_run_and_out(tmp_path, capsys):
    run = make_run(tmp_path / "run")
    assert plot_main([str(run), "--title", "hello"]) == 0
    _check_png(run / "training.png")
    out = tmp_path / "sub" / "mine.png"
    assert plot_main([str(run), "--out", str(out)]) == 0
    _check_png(out)
    assert f"Wrote {out}" in capsys.readouterr().out


def test_folder_without_training_csv(tmp_path):
    folder = tmp_path / "not_a_run"
    folder.mkdir()
    with pytest.raises(CnnsError, match="not_a_run") as info:
        plot_main([str(folder)])
    assert str(folder) in str(info.value) and "\n" not in str(info.value)
    missing = tmp_path / "missing"
    with pytest.raises(CnnsError) as info:
        read_run(missing)
    assert str(missing) in str(info.value)
    assert plot_training(folder) is None
    assert not (folder / "training.png").exists()


def test_plot_training_header_only(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    _write_csv(folder / "training.csv", TRAINING_COLUMNS, [])
    assert plot_training(folder) is None
    assert not (folder / "training.png").exists()
    with pytest.raises(CnnsError, match="training.csv"):
        read_run(folder)
    (folder / "training.csv").write_text("")
    assert plot_training(folder) is None
    assert not (folder / "training.png").exists()
