import subprocess
import sys


def _pdserve(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_generate_prints_one_completion_per_prompt(demo_model_dir):
    r = _pdserve("generate", "--model", str(demo_model_dir), "--max-tokens", "8", "--ignore-eos", "Hello", "The sea")
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) >= 2


def test_bad_arguments_give_one_line_errors(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "falcon"}')
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(20))
    for args, msg in [
        (["generate", "--model", str(tmp_path / "broken.gguf"), "hi"], "as GGUF"),
        (["generate", "--model", str(tmp_path / "missing"), "hi"], "model directory not found"),
        (["generate", "--model", str(tmp_path), "hi"], "unsupported architecture 'falcon'"),
        (["generate", ""], "prompt must not be empty"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    ]:
        r = _pdserve(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("error: ") and msg in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1


def _modules_after(argv: list[str]) -> set[str]:
    code = (
        "import sys\n"
        "from deploy import cli\n"
        "try:\n"
        f"    cli.main({argv!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.rsplit("MODULES ", 1)[1].split())


def test_help_loads_neither_ray_nor_torch():
    """`pdserve serve --help` reads ClusterConfig (and the component configs it takes its defaults
    from) only: the serving cluster, Ray and torch are imported when `serve` runs."""
    loaded = _modules_after(["serve", "--help"])
    assert not loaded & {"ray", "torch", "fastapi", "uvicorn", "loadtest", "decode_worker", "prefill_worker"}, loaded


def test_generate_does_not_load_ray(demo_model_dir):
    loaded = _modules_after(["generate", "--model", str(demo_model_dir), "--max-tokens", "2", "--ignore-eos", "Hi"])
    assert "torch" in loaded and not loaded & {"ray", "fastapi", "loadtest"}, loaded


def test_tools_run_through_their_entry_point_and_deploy_never_imports_them(monkeypatch, capsys):
    """`pdserve loadtest ARGS` calls the `pdserve.commands` entry point named loadtest with ARGS (the
    tool's own parser), and says how to install it where it is not: deploy imports no tool."""
    import tomllib
    from pathlib import Path

    from deploy import cli

    project = tomllib.loads((Path(cli.__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert project["entry-points"][cli.TOOL_GROUP]["loadtest"] == "loadtest.run:main"
    assert project["scripts"]["pdserve-loadtest"] == "loadtest.run:main"

    calls = []

    class FakeEntryPoint:
        def load(self):
            return lambda argv, prog: calls.append((argv, prog)) or 7

    seen = []
    monkeypatch.setattr(cli, "entry_points", lambda group, name: seen.append((group, name)) or [FakeEntryPoint()])
    assert cli.main(["loadtest", "--steps", "1,2"]) == 7
    assert seen == [("pdserve.commands", "loadtest")] and calls == [(["--steps", "1,2"], "pdserve loadtest")]

    monkeypatch.setattr(cli, "entry_points", lambda group, name: [])
    assert cli.main(["loadtest", "--help"]) == 2
    assert "pdserve loadtest` is not installed" in capsys.readouterr().err
