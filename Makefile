# onnx2fused developer workflow. Needs only python3 (with venv + pip) on a fresh clone.
#   make venv    create .venv (if missing) and (re)install when pyproject.toml changed
#   make test    run the test suite (pytest -q -n 2)
#   make demo    convert a zoo model and print the conversion report
#   make zoo     regenerate models/ (the zoo) with PyTorch
#   make wheel   build dist/onnx2fused-*.whl (in a small build venv: the dev venv is not needed)
#   make clean   remove build outputs (keeps .venv; `make distclean` removes it too)

PYTHON      ?= python3
VENV        ?= .venv
TORCH       ?= torch==2.13.0
# PyTorch's CPU wheel index: PyPI's Linux torch is the CUDA build (it pulls the nvidia-* packages, several
# GB), pinned or not. `make venv TORCH_INDEX=` takes torch from the usual index (and pip's find-links).
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
EXTRAS      ?= cpu,test
PYTEST_ARGS ?=
XDIST       ?= -n 2 --dist loadgroup
DEMO        ?= nerf
DEMO_EXPORT ?= opset17

VPY   := $(VENV)/bin/python
WHEEL_VENV := build/wheel-venv
STAMP := $(VENV)/.stamp
ZOO   := models/zoo.json

.PHONY: venv test demo zoo wheel clean distclean help

help:
	@sed -n 's/^#   //p' $(firstword $(MAKEFILE_LIST))

venv: $(STAMP)

# The stamp is newer than pyproject.toml once the install for that pyproject.toml succeeded.
# torch is installed first, pinned, from the CPU index without its dependencies (so that nothing of the
# CUDA build is resolved), then again from the usual index, which adds its (CPU build's) dependencies.
# pip's own configuration (find-links, extra index URLs) still applies to the first step.
$(STAMP): pyproject.toml
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q --no-deps "$(TORCH)" $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VPY) -m pip install -q "$(TORCH)"
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	@touch $@

# pytest exits 5 when it collects no tests: that is not a failure here.
test: venv
	@rc=0; $(VPY) -m pytest -q $(XDIST) $(PYTEST_ARGS) || rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: no tests collected"; rc=0; fi; exit $$rc

# Built only when missing (the zoo is committed); `make zoo` forces a rebuild.
$(ZOO): | $(STAMP)
	$(VPY) models/build_zoo.py

zoo: venv
	$(VPY) models/build_zoo.py

demo: venv $(ZOO)
	@mkdir -p build/demo
	$(VENV)/bin/onnx2fused convert models/$(DEMO).$(DEMO_EXPORT).onnx -o build/demo/$(DEMO).fused.onnx

# Only python3 (venv + pip) is needed: a small venv under build/ runs `pip wheel`, whose isolated build
# fetches setuptools; the wheel is pure Python (the kernels are generated and compiled at convert time).
wheel:
	@test -x $(WHEEL_VENV)/bin/python || $(PYTHON) -m venv $(WHEEL_VENV)
	rm -rf build/lib build/bdist.*    # setuptools would package stale files left there by an older build
	$(WHEEL_VENV)/bin/python -m pip wheel -q --no-deps --wheel-dir dist .
	@ls -1 dist/onnx2fused-*.whl

clean:
	rm -rf build dist *.egg-info .pytest_cache .hypothesis
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

distclean: clean
	rm -rf $(VENV)
