# pdmesh: `make up` installs and runs the main job; `make test` installs and runs the suite.
PY := .venv/bin/python
MODEL_DIR ?= .cache/models/tiny-qwen3
# make test's pytest workers: one more than the cores (a worker waiting on processes that
# start and stop leaves its core to the others), at most 6; a file's tests stay on one
# worker (they share its meshes)
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n + 1 < 6 ? n + 1 : 6 )))

.PHONY: install up test test-compose image compose-up compose-down lint bench proto docs \
	reference clean

install:
	@bash scripts/setup.sh

up: install
	@bash scripts/ensure_redis.sh
	$(PY) -m pdmesh up  # makes the tiny demo model in $(MODEL_DIR) on first use

test: install
	@bash scripts/ensure_redis.sh
	.venv/bin/ruff check pdmesh shared services tests scripts
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=30 tests \
		--ignore=tests/compose

# the image (scripts/image.sh: offline, from a host-built wheelhouse; BASE=debian builds
# the base with debootstrap), then the whole mesh under `docker compose`
image: install
	@bash scripts/ensure_docker.sh
	BASE=$${BASE:-debian} bash scripts/image.sh

test-compose: image
	$(PY) -m pytest -q tests/compose

# the mesh under `docker compose` on this machine: the image, then the demo model (unless
# MODEL_DIR names a model folder) served at http://localhost:8000/v1; redis runs from the
# base image `make image` built (REDIS_IMAGE=... to pick another)
compose-up: image
	@[ -f $(MODEL_DIR)/config.json ] || [ "$(MODEL_DIR)" != .cache/models/tiny-qwen3 ] \
	  || $(PY) -m pdmesh make-tiny-model $(MODEL_DIR) --arch qwen3
	@[ -f $(MODEL_DIR)/config.json ] || { echo "compose-up: no config.json in $(MODEL_DIR)" >&2; exit 2; }
	MODEL_DIR=$(abspath $(MODEL_DIR)) REDIS_IMAGE=$${REDIS_IMAGE:-pdmesh-base:bookworm} \
	  docker compose up -d --wait

compose-down:
	docker compose down -v

lint: install
	.venv/bin/ruff check pdmesh shared services tests scripts

bench: install
	@[ -f $(MODEL_DIR)/config.json ] || $(PY) -m pdmesh make-tiny-model $(MODEL_DIR) --arch qwen3
	$(PY) -m pdmesh bench offline --model $(MODEL_DIR)

proto: install
	@bash scripts/gen_proto.sh $(PY)

# the user guide as a site in site/ (mkdocs.yml; strict: a broken link, anchor or page
# left out of the nav fails the build)
docs: install
	.venv/bin/mkdocs build --strict --site-dir site

# rewrite the generated pages in docs/reference/ from the flag table and the config schema
reference: install
	$(PY) -m pdmesh.shared.config.reference

clean:
	rm -rf .venv .cache
