"""The core and the simulator import and run without torch (a blocked import, as on a machine without it)."""

import subprocess
import sys
import textwrap


def test_core_imports_without_torch():
    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in ('torch', 'triton', 'pandas'):
                    raise ImportError('blocked ' + name)
        sys.meta_path.insert(0, Block())
        import bullet, bullet.config, bullet.engine, bullet.metrics, bullet.traces, bullet.cli
        import bullet.policies, bullet.perfmodel.roofline, simulator
        from bullet.config import MODELS, GPUS, SchedulerConfig
        from bullet.request import Request
        reqs = [Request(i, i * 0.1, 100, 5) for i in range(10)]
        res = simulator.simulate(reqs, MODELS['llama-3.1-8b'], GPUS['h200'], SchedulerConfig())
        assert res.summary['requests'] == 10
        assert 'torch' not in sys.modules
        print('ok')
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
