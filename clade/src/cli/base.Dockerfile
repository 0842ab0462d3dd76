# The base template (`clade template build base`): what code written for E2B's base
# template expects of a sandbox. Debian; the user `user` (uid 1000, home /home/user,
# passwordless sudo) whom commands and files belong to by default; curl, git, python3 with
# pip and venv, and the usual tools. Its RUN steps need a network (the build gets one).
# BASE: any Debian or Ubuntu image (--build-arg BASE=...).
ARG BASE=debian:bookworm
FROM ${BASE}
ENV LANG=C.UTF-8 PIP_BREAK_SYSTEM_PACKAGES=1
RUN set -e; missing=; \
    for t in sudo curl git python3 pip3 ps ip less unzip; do command -v "$t" >/dev/null || missing=1; done; \
    if [ -n "$missing" ]; then \
        apt-get update; \
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
            sudo curl ca-certificates git python3 python3-pip python3-venv procps iproute2 \
            less unzip nano; \
        rm -rf /var/lib/apt/lists/*; \
    fi
RUN set -e; id -u user >/dev/null 2>&1 || useradd --create-home --uid 1000 --shell /bin/bash user; \
    echo 'user ALL=(ALL:ALL) NOPASSWD: ALL' >/etc/sudoers.d/user; chmod 0440 /etc/sudoers.d/user
USER user
WORKDIR /home/user
