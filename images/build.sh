#!/usr/bin/env bash
# Build (and with PUSH=1 push) the two ardit images from the repository root:
#   $REGISTRY/ardit-gpu:$VERSION-$SHA     AR, DiT and sweep steps (CUDA)
#   $REGISTRY/ardit-tools:$VERSION-$SHA   shard / summary steps, launcher, Mooncake servers
# VERSION comes from pyproject.toml, SHA is the short git commit (+ "-dirty" with uncommitted
# changes, so a tag never names two different builds).
# Then it pins those references in the kustomize component that every overlay includes
# ($IMAGES_FILE, default manifests/images/kustomization.yaml): the one place the manifests, the
# Argo templates and cron, and the KFP commands (--images) take images from.
# DRY_RUN=1 prints the docker commands only (and writes $IMAGES_FILE only if you set it).
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

if [ "${DRY_RUN:-0}" != 1 ] || [ -n "${IMAGES_FILE:-}" ]; then
  IMAGES_FILE="${IMAGES_FILE:-manifests/images/kustomization.yaml}"
  cat > "$IMAGES_FILE" <<YAML
# The one place that names the ardit images a deployment runs: every manifest and Argo template
# refers to \`ardit-gpu\` / \`ardit-tools\`, and overlays include this component to pin them.
# images/build.sh rewrites this file with what it built (REGISTRY/ardit-NAME:VERSION-GITSHA);
# KFP commands read it too: \`ardit submit|schedule|compile --images manifests/images/kustomization.yaml\`.
apiVersion: kustomize.config.k8s.io/v1alpha1
kind: Component
configurations:
  - argo-images.yaml
images:
  - name: ardit-gpu
    newName: $REGISTRY/ardit-gpu
    newTag: $TAG
  - name: ardit-tools
    newName: $REGISTRY/ardit-tools
    newTag: $TAG
YAML
  echo "pinned in $IMAGES_FILE"
  # Nothing running picks the new images up by itself (docs/deploy.md section 1, "After every rebuild").
  echo "next: kubectl apply -k your overlay; the cron: kubectl get cronworkflow ... | ardit pin-images --images $IMAGES_FILE | kubectl replace -f -"
fi

# What the cluster will run (docs/deploy.md):
echo "gpu_image=$REGISTRY/ardit-gpu:$TAG"
echo "tools_image=$REGISTRY/ardit-tools:$TAG"
