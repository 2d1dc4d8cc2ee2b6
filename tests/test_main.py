"""The README's main job runs and reports every site with its accuracy."""
import subprocess
import sys


def test_main_job_cpu():
    p = subprocess.run([sys.executable, "-m", "sage_compile", "--tokens", "64", "--iters", "1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    out = p.stdout
    assert out.count("replaced 2/2 attention sites") == 2
    assert "gqa=4/2" in out and "NHD" in out
    assert out.count("model output vs eager: cos 0.99") == 2
    assert "time per forward" in out
