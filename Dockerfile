# podmeter image: the agent, the operator and the tools (inspect, doctor) in one image.
#
#   docker build -t podmeter:0.1.0 .
#
# Three stages: `bpf` compiles the eBPF object with clang (the only stage with a compiler), `build`
# installs the package without its lab and its dependencies into a virtualenv, `runtime` is a slim Python
# with the system libbpf (libbpf1) and that virtualenv. Nothing is compiled at run time.
#
# The image runs as an unprivileged user (65532) by default: that is how the operator runs. The agent's
# DaemonSet overrides it with runAsUser 0 and only these capabilities (drop ALL), because the kernel
# checks them on the calls the agent makes (docs/install.md, "What the agent needs, and why"):
#   CAP_BPF        create the maps, load the programs, pin them under /sys/fs/bpf (kernel >= 5.8)
#   CAP_NET_ADMIN  load TC (sched_cls) programs and attach them to the host-side veths (TCX or clsact)
# and, only where needed (kustomize components):
#   CAP_PERFMON    a verifier that refuses the programs' packet-pointer arithmetic under its Spectre v1
#                  rules when the loader lacks it (deploy/components/perfmon)
#   CAP_SYS_ADMIN  a container runtime or seccomp profile that predates CAP_BPF: there, bpf(2) is allowed
#                  for CAP_SYS_ADMIN alone (deploy/components/sys-admin)
# On nodes that do not mount the bpf filesystem at boot, deploy/components/mount-bpffs runs `podmeter bpffs`
# from this image as a privileged init container, which mounts it in the node's mount namespace.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG DEBIAN_IMAGE=debian:bookworm-slim

FROM ${DEBIAN_IMAGE} AS bpf
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends clang libbpf-dev linux-libc-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY bpf/ bpf/
RUN mkdir -p out \
 && for source in bpf/*.bpf.c; do \
      name=$(basename "$source" .c); \
      clang -O2 -g -Wall -target bpf -I/usr/include/$(uname -m)-linux-gnu -Ibpf -c "$source" -o "out/$name.o"; \
    done

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/podmeter
WORKDIR /src
COPY pyproject.toml ./
COPY src/ src/
COPY --from=bpf /src/out/ src/podmeter/bpf/
# The image is the product only: no lab (podmeter.lab and its commands lab, apiserver, node) and none of its
# packages (matplotlib with numpy and pillow, rich). Those packages are the `lab` extra, which this install
# leaves out. The lab's modules must be removed here, before the install: an extra can only add
# dependencies, not leave files out of the wheel, and excluding podmeter.lab in pyproject.toml instead
# would take it out of every install, including `pip install 'podmeter[lab]'` and the editable one of
# scripts/setup.sh. In the image `podmeter lab|apiserver|node` say that they need the lab extra.
RUN rm -r src/podmeter/lab src/podmeter/cli/lab.py src/podmeter/cli/apiserver.py src/podmeter/cli/node.py
# `podmeter --version` names the commit the image was built from when the build is given it
# (docker build --build-arg PODMETER_COMMIT=$(git rev-parse --short=12 HEAD) .): the image has no git.
ARG PODMETER_COMMIT=""
RUN if [ -n "$PODMETER_COMMIT" ]; then printf '%s\n' "$PODMETER_COMMIT" > src/podmeter/COMMIT; fi
RUN /opt/podmeter/bin/pip install . \
 && /opt/podmeter/bin/python -c "import importlib.resources as r; assert r.files('podmeter').joinpath('bpf/podmeter.bpf.o').is_file()" \
 && /opt/podmeter/bin/python -c "import importlib.util as u; assert not [m for m in ('podmeter.lab', 'matplotlib', 'rich', 'numpy', 'PIL') if u.find_spec(m)]" \
 && /opt/podmeter/bin/podmeter --help >/dev/null

FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="podmeter" \
      org.opencontainers.image.description="Pod-level network observability agent for Kubernetes with an eBPF datapath"
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends libbpf1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/podmeter /opt/podmeter
ENV PATH=/opt/podmeter/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 65532:65532
EXPOSE 9978 9979
ENTRYPOINT ["podmeter"]
CMD ["--help"]
