import subprocess
import sys


# Generous: `generate` imports torch (~10 s of CPU), minutes at the other test stream's nice 10 on a busy machine.
def _pdserve(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "deploy.cli", *args], capture_output=True, text=True, timeout=timeout)


# `python -m deploy.cli ARGS` (its real exit code and output), which then prints the top-level packages
# it loaded on stderr's last line, `MODULES a b c`, from an exit hook (so after a SystemExit too).
_RUN_CLI_AND_LIST_MODULES = (
    "import atexit, runpy, sys\n"
    "atexit.register(lambda: print('MODULES', ' '.join(sorted({m.split('.')[0] for m in sys.modules})), "
    "file=sys.stderr))\n"
    "sys.argv = ['deploy.cli', *sys.argv[1:]]\n"
    "runpy.run_module('deploy.cli', run_name='__main__', alter_sys=True)\n"
)


def _run_listing_modules(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    """The command's result and the top-level packages it loaded."""
    r = subprocess.run([sys.executable, "-c", _RUN_CLI_AND_LIST_MODULES, *args], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return r, set(r.stderr.rsplit("MODULES ", 1)[1].split())


def test_generate_prints_one_completion_per_prompt_and_does_not_load_ray(demo_model_dir):
    r, loaded = _run_listing_modules("generate", "--model", str(demo_model_dir), "--max-tokens", "8", "--ignore-eos",
                                     "Hello", "The sea")
    assert len(r.stdout.splitlines()) >= 2
    assert "torch" in loaded and not loaded & {"ray", "fastapi", "loadtest"}, loaded


def test_bad_arguments_give_one_line_errors(tmp_path, capsys):
    """One through the real command (its exit code and stderr), the others through its entry point
    in-process (the same main(argv) and the same printing)."""
    from deploy import cli

    (tmp_path / "config.json").write_text('{"model_type": "falcon"}')
    (tmp_path / "broken.gguf").write_bytes(b"GGUF" + bytes(20))
    r = _pdserve("generate", "--model", str(tmp_path / "broken.gguf"), "hi")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and "as GGUF" in r.stderr and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    for args, msg in [
        (["generate", "--model", str(tmp_path / "missing"), "hi"], "model directory not found"),
        (["generate", "--model", str(tmp_path), "hi"], "unsupported architecture 'falcon'"),
        (["generate", ""], "prompt must not be empty"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    ]:
        capsys.readouterr()
        code = cli.main(args)
        out, err = capsys.readouterr()
        assert code == 2, (args, err)
        assert err.startswith("error: ") and msg in err and "Traceback" not in err, (args, err)
        assert len(err.strip().splitlines()) == 1


def test_help_loads_neither_ray_nor_torch():
    """`pdserve serve --help` reads ClusterConfig (and the component configs it takes its defaults
    from) only: the serving cluster, Ray and torch are imported when `serve` runs."""
    _, loaded = _run_listing_modules("serve", "--help")
    assert not loaded & {"ray", "torch", "fastapi", "uvicorn", "loadtest", "decode_worker", "prefill_worker"}, loaded


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
