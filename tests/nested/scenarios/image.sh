#!/bin/busybox sh
# shellcheck shell=dash disable=SC2016,SC2046  # single-quoted commands run in the guest's sh
# image.sh: L1 scenario (run.sh --l1-test, or one of suite.sh's): a template built from a
# container image boots Debian's kernel with Clade's agent, which makes the image's root
# filesystem its root, and runs commands in it.
#
#   tests/nested/run.sh \
#       --l1-test tests/nested/scenarios/image.sh --expect IMAGE-SCENARIO-PASS
#
# The image is made here from what L1 has (busybox-static and a few files, the tar layer
# gzipped, blobs named by their sha256, an OCI layout with index, manifest and config);
# `clade template build --image` unpacks it into an ext4 disk and boots it, its setup
# commands (--run, which fail the build when they fail) checking from inside the guest
# that / is the image's filesystem: its files, its owner and mode, a file a second layer
# deleted gone (whiteout). `clade run --image` of that image converts it once and runs a
# command in it (its Env, WorkingDir, exit code), a second run restores the cached one. Then a Dockerfile FROM that image (`template build
# --dockerfile`): its COPY and RUN steps run in a build VM (as root and as USER 1000, with
# ENV, ARG and WORKDIR), the template's setup commands check their files, owners and
# links; a rebuild whose last step changed runs only that step (the rest cached); a step
# that fails fails the build with its line and output, registering nothing.
# Needs mkfs.ext4 in L1 (run.sh stages it, NESTED_L1_BINS).
# scenario-timeout: 600

CLADE=/bin/clade
W=/tmp/image-scenario
fail() {
    echo "IMAGE-SCENARIO-FAIL $*"
    [ -f "$W/build.err" ] && cat "$W/build.err"
    for f in "$W"/state/templates/*/build.serial "$W"/state/templates/*/build.log; do
        [ -f "$f" ] && { echo "---- $f ----"; tail -n 40 "$f"; }
    done
    # This machine's /tmp is memory: the scenarios after this one need it.
    rm -rf "$W"
    exit 1
}
[ -x /usr/sbin/mkfs.ext4 ] || [ -x /sbin/mkfs.ext4 ] ||
    fail "mkfs.ext4 is not in L1 (run.sh stages it: NESTED_L1_BINS)"
rm -rf "$W"
mkdir -p "$W/l1/bin" "$W/l1/etc" "$W/l1/home/user" "$W/l2/etc" "$W/layout/blobs/sha256"

# Layer 1: busybox and its applets, an os-release, a home owned by uid 1000.
cp /bin/busybox "$W/l1/bin/busybox"
for a in sh cat grep test stat sync ls echo true id chown ln mkdir readlink; do ln -s busybox "$W/l1/bin/$a"; done
echo "ID=clade-image-test" >"$W/l1/etc/os-release"
echo "doomed" >"$W/l1/etc/doomed"
echo "# rc" >"$W/l1/home/user/.profile"
chown -R 1000:1000 "$W/l1/home/user"
chmod 750 "$W/l1/home/user"
# Layer 2: deletes etc/doomed (a whiteout), adds a file.
: >"$W/l2/etc/.wh.doomed"
echo "layer two" >"$W/l2/etc/motd"

# blob FILE: stores FILE under its digest; prints "sha256:<hex> <size>".
blob() {
    h=$(sha256sum "$1" | cut -d' ' -f1)
    cp "$1" "$W/layout/blobs/sha256/$h"
    echo "sha256:$h $(stat -c %s "$1")"
}
layers="" diff_ids=""
for l in l1 l2; do
    tar -C "$W/$l" -cf "$W/$l.tar" . || fail "tar $l"
    d=$(sha256sum "$W/$l.tar" | cut -d' ' -f1)
    gzip -c "$W/$l.tar" >"$W/$l.tar.gz"
    set -- $(blob "$W/$l.tar.gz")
    layers="$layers${layers:+,}{\"mediaType\":\"application/vnd.oci.image.layer.v1.tar+gzip\",\"digest\":\"$1\",\"size\":$2}"
    diff_ids="$diff_ids${diff_ids:+,}\"sha256:$d\""
done
printf '{"architecture":"amd64","os":"linux","config":{"Env":["GREETING=hello"],"WorkingDir":"/home/user","Cmd":["/bin/sh"]},"rootfs":{"type":"layers","diff_ids":[%s]}}' \
    "$diff_ids" >"$W/config.json"
set -- $(blob "$W/config.json")
printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"%s","size":%s},"layers":[%s]}' \
    "$1" "$2" "$layers" >"$W/manifest.json"
set -- $(blob "$W/manifest.json")
printf '{"schemaVersion":2,"manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"%s","size":%s}]}' \
    "$1" "$2" >"$W/layout/index.json"
echo '{"imageLayoutVersion":"1.0.0"}' >"$W/layout/oci-layout"

$CLADE template build img --image "$W/layout" --state-dir "$W/state" \
    --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem 256 --agent-timeout 240 \
    --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" \
    --run 'grep -q "^ID=clade-image-test$" /etc/os-release' \
    --run 'test "$(stat -c "%u %a" /home/user)" = "1000 750"' \
    --run 'test ! -e /etc/doomed' \
    --run 'grep -q "layer two" /etc/motd' \
    2>"$W/build.err" || fail "template build --image"
grep -q "CLADE-AGENT-ROOT /dev/vda ext4" "$W"/state/templates/img/build.serial ||
    fail "the guest did not make the image's disk its root"
cat "$W/build.err"
grep -q "2 layers" "$W/build.err" || fail "the build did not report the image's 2 layers"
grep -q '"GREETING": "hello"' "$W"/state/templates/img/template.json ||
    fail "the template does not record the image's Env"

# --- clade run --image: converted once, then each run from the cached snapshot -------------
export CLADE_HOME="$W/home"
mkdir -p "$CLADE_HOME/guest"
ln -s /guest/vmlinuz "$CLADE_HOME/guest/vmlinuz"
ln -s /guest/initrd.cpio "$CLADE_HOME/guest/initrd"
$CLADE run --image "$W/layout" -- cat /etc/os-release >"$W/run1.out" 2>"$W/run1.err" ||
    { cat "$W/run1.err"; fail "clade run --image"; }
cat "$W/run1.err"
grep -q "^ID=clade-image-test$" "$W/run1.out" || fail "clade run --image did not run the command in the image"
grep -q "converted in" "$W/run1.err" || fail "the first clade run --image did not convert the image"
rc=0
$CLADE run --image "$W/layout" -- sh -c 'echo "$GREETING"; pwd; exit 5' >"$W/run2.out" 2>"$W/run2.err" || rc=$?
cat "$W/run2.err" "$W/run2.out"
[ "$rc" = 5 ] || fail "clade run --image did not pass on the command's exit code (got $rc)"
grep -q "cached" "$W/run2.err" || fail "the second clade run --image converted the image again"
[ "$(cat "$W/run2.out")" = "hello
/home/user" ] || fail "the command did not get the image's Env and WorkingDir"
[ -z "$(ls "$CLADE_HOME/run")" ] || fail "clade run --image left its VM's files behind"
unset CLADE_HOME

# --- a Dockerfile FROM that image ---------------------------------------------------------
C="$W/ctx"
mkdir -p "$C/app/conf"
cp -r "$W/layout" "$C/base"
echo "data" >"$C/app/data.txt"
echo "k=v" >"$C/app/conf/app.conf"
ln -s data.txt "$C/app/link"
printf '#!/bin/sh\necho tool-ran\n' >"$C/tool.sh"
chmod 755 "$C/tool.sh"
dockerfile() { # $1: the last RUN's text
    cat >"$C/Dockerfile" <<EOF
FROM base
ARG WHO=world
ENV GREETING="hello \$WHO"
WORKDIR /srv/app
COPY --chown=1000:1000 app/ ./
COPY tool.sh /usr/local/bin/
RUN echo "\$GREETING" > greeting && id -u > made-by
USER 1000
RUN $1
CMD ["/bin/sh"]
EOF
}
dfbuild() { # $1: template name; the rest: extra arguments
    n=$1
    shift
    $CLADE template build "$n" --dockerfile "$C/Dockerfile" --state-dir "$W/state" \
        --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem 256 --agent-timeout 240 \
        --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" "$@"
}
dockerfile 'id -u > step2 && echo one >> step2'
dfbuild df1 \
    --run 'test "$(cat /srv/app/greeting)" = "hello world"' \
    --run 'test "$(cat /srv/app/made-by)" = 0' \
    --run 'test "$(cat /srv/app/step2)" = "1000
one"' \
    --run 'test "$(stat -c %u /srv/app/step2)" = 1000' \
    --run 'test "$(stat -c %u:%g /srv/app/data.txt)" = 1000:1000' \
    --run 'test "$(stat -c %u /srv/app/conf/app.conf)" = 1000' \
    --run 'test "$(readlink /srv/app/link)" = data.txt' \
    --run 'test "$(/usr/local/bin/tool.sh)" = tool-ran' \
    --run 'grep -q "^ID=clade-image-test$" /etc/os-release' \
    2>"$W/df1.err" || { cat "$W/df1.err"; fail "template build --dockerfile"; }
cat "$W/df1.err"
grep -q "4 steps, 0 cached, 4 run" "$W/df1.err" || fail "the first Dockerfile build did not run its 4 steps"
grep -q '"GREETING": "hello world"' "$W"/state/templates/df1/template.json ||
    fail "the template does not keep the Dockerfile's ENV"
grep -q '"user": "1000"' "$W"/state/templates/df1/template.json ||
    fail "the template does not keep the Dockerfile's USER"
grep -q "/4 steps" "$W/df1.err" && fail "a build off a terminal drew its steps bar"
# Only the last step changed: only it runs. On a terminal (util-linux `script`, staged by
# run.sh): the steps bar is drawn and ends at 4/4.
dockerfile 'id -u > step2 && echo two >> step2'
cat >"$W/df2.sh" <<'DF2'
$CLADE template build df2 --dockerfile "$C/Dockerfile" --state-dir "$W/state" \
    --kernel /guest/vmlinuz --initrd /guest/initrd.cpio --mem 256 --agent-timeout 240 \
    --cmdline "console=ttyS0 panic=-1 quiet clade.root=/dev/vda" \
    --run 'test "$(cat /srv/app/step2)" = "1000
two"' --run 'test "$(cat /srv/app/greeting)" = "hello world"'
DF2
TERM=xterm CLADE=$CLADE C=$C W=$W /usr/bin/script -qec "sh $W/df2.sh" /dev/null >"$W/df2.err" 2>&1 </dev/null ||
    { cat "$W/df2.err"; fail "the second Dockerfile build"; }
tr '\r' '\n' <"$W/df2.err" | grep -v '^$' | tail -n 20
grep -q "4 steps, 3 cached, 1 run" "$W/df2.err" || fail "the rebuild did not take its unchanged steps from the cache"
grep -q "4/4 steps" "$W/df2.err" || fail "no steps bar at 4/4 on a terminal"
# A step that fails: its line and output, no template.
dockerfile 'echo step-output-here; exit 3'
if dfbuild dfbad 2>"$W/dfbad.err"; then fail "a failing RUN step did not fail the build"; fi
cat "$W/dfbad.err"
grep -q "line 9" "$W/dfbad.err" || fail "the failed build does not name the line"
grep -q "step-output-here" "$W/dfbad.err" || fail "the failed build does not show the step's output"
[ ! -e "$W/state/templates/dfbad" ] || fail "a failed build left its template directory"
# This machine's /tmp is memory (templates are snapshots of whole VMs): the scenarios
# after this one need it.
rm -rf "$W"
echo "IMAGE-SCENARIO-PASS"
