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
    for args, msg in [
        (["generate", "--model", str(tmp_path / "missing"), "hi"], "model directory not found"),
        (["generate", "--model", str(tmp_path), "hi"], "unsupported architecture 'falcon'"),
        (["generate", ""], "prompt must not be empty"),
        (["generate", "--max-tokens", "0", "hi"], "max_tokens"),
    ]:
        r = _pdserve(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert r.stderr.startswith("error: ") and msg in r.stderr and "Traceback" not in r.stderr
        assert len(r.stderr.strip().splitlines()) == 1
