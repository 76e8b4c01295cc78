# Sourced by the device scripts (bench/session*_gpu*.sh) after they set O (their output folder):
# installs the carried DeepSpeed wheels (.whl/, anchors.md) into /tmp/site when present, installs
# this repository, and writes what the machine is to $O/machine.txt.
if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1
{ nvidia-smi -L; nproc; free -g | head -2; python3 -c 'import torch; print(torch.__version__, torch.cuda.device_count())'; } > "$O/machine.txt" 2>&1
