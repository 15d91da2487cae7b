#!/usr/bin/env bash
# Build (and with PUSH=1 push) the two ardit images from the repository root:
#   $REGISTRY/ardit-gpu:$VERSION-$SHA     AR + DiT steps (CUDA)
#   $REGISTRY/ardit-tools:$VERSION-$SHA   CPU steps + Mooncake servers
# VERSION comes from pyproject.toml, SHA is the short git commit (+ "-dirty" with uncommitted
# changes, so a tag never names two different builds). DRY_RUN=1 prints the commands only.
set -euo pipefail

cd "$(dirname "$0")/.."
REGISTRY="${REGISTRY:?set REGISTRY, e.g. REGISTRY=ghcr.io/acme}"
VERSION="${VERSION:-$(sed -n 's/^version *= *"\(.*\)"/\1/p' pyproject.toml | head -n1)}"
SHA="$(git rev-parse --short=12 HEAD)"
if [ -n "$(git status --porcelain -- components pipeline images pyproject.toml)" ]; then SHA="$SHA-dirty"; fi
TAG="$VERSION-$SHA"

run() { echo "+ $*"; if [ "${DRY_RUN:-0}" != 1 ]; then "$@"; fi; }

for image in gpu tools; do
  run docker build -f "images/$image.Dockerfile" -t "$REGISTRY/ardit-$image:$TAG" \
      --label "org.opencontainers.image.revision=$(git rev-parse HEAD)" \
      --label "org.opencontainers.image.version=$VERSION" .
  if [ "${PUSH:-0}" = 1 ]; then run docker push "$REGISTRY/ardit-$image:$TAG"; fi
done

# What to hand to the workflows (docs/deploy.md):
echo "gpu_image=$REGISTRY/ardit-gpu:$TAG"
echo "tools_image=$REGISTRY/ardit-tools:$TAG"
