#!/usr/bin/env bash
# `make docker-image`: the wheelhouse from the project's own dependency set, then the peer image from it.
# The wheelhouse (docker/wheelhouse) is the only step that uses the network (the package index); the image
# build installs from it with no index, so it works on a machine without registry access too.
# Usage: docker/build-image.sh [--local-base]
#   --local-base       build FROM a local Debian base (docker/make-base-image.sh, made once and cached by tag)
#                      instead of python:3.11-slim, for machines with no container registry
# Environment: PYTHON (a Python 3.11 with pip, default python3), IMAGE (default swarmd:latest), BASE_IMAGE,
#              PIP_EXTRA_INDEX_URL (e.g. a CPU wheel index, where the default index has only CUDA torch builds)
# Last line: one JSON object with the image, its base and its size.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
IMAGE=${IMAGE:-swarmd:latest}
BASE_IMAGE=${BASE_IMAGE:-python:3.11-slim}
case "${1:-}" in
    --local-base) BASE_IMAGE=$(docker/make-base-image.sh) ;;
    "") ;;
    *) echo "build-image: unknown argument $1 (usage: docker/build-image.sh [--local-base])" >&2; exit 2 ;;
esac

# the wheels must fit the image's Python (3.11, the version every base here carries)
"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || { echo "build-image: PYTHON=$PYTHON is not Python 3.11, the image's Python" >&2; exit 2; }
wheels=docker/wheelhouse
find "$wheels" -name '*.whl' -delete
# the project's dependency set as pyproject.toml declares it (torch==2.13.0, the pin the Makefile installs),
# plus the build backend pip needs to install the project itself without an index
"$PYTHON" -m pip wheel --quiet --wheel-dir "$wheels" . 'setuptools>=68' >&2
rm -f "$wheels"/swarmd-*.whl   # the image builds the project from its sources
if ls "$wheels" | grep -q '^nvidia_'; then
    echo "build-image: the wheelhouse got a CUDA build of torch; set PIP_EXTRA_INDEX_URL to a CPU wheel index" >&2
    exit 2
fi

# --network none: the build installs from the wheelhouse alone, and this proves it
docker build --network none --file docker/Dockerfile --build-arg BASE_IMAGE="$BASE_IMAGE" --tag "$IMAGE" . >&2
size=$(docker image inspect --format '{{.Size}}' "$IMAGE")
wheel_mb=$(du -sm "$wheels" | cut -f1)
echo "{\"image\": \"$IMAGE\", \"base_image\": \"$BASE_IMAGE\", \"size_mb\": $((size / 1000000)), \"wheelhouse_mb\": $wheel_mb}"
