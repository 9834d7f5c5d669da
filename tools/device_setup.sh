#!/usr/bin/env bash
# Set up the GPU machine for this project: carried wheels (if any, from .whl/, which git ignores) and an
# editable install of bullet without dependencies (the machine's image brings torch, Triton, numpy, ...).
# Usage on the device: `source tools/device_setup.sh` (exports PYTHONPATH) or `bash tools/device_setup.sh`.
set -e
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
python3 -c "import torch, bullet; print('bullet', bullet.__version__, 'torch', torch.__version__, 'cuda', torch.cuda.is_available())"
set +e
