# Shared by gpu_checks.sh and multi_gpu_checks.sh (sourced): `step NAME SECONDS COMMAND...` runs the command if NAME
# is in $wanted, under its own time limit so one slow or failing step leaves the others' figures, logs it to
# $out/NAME.log, and prints its status and last lines.
step() {
    local name=$1 limit=$2
    shift 2
    [[ $wanted == *" $name "* ]] || return 0
    local start=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    echo "== $name: rc=$? in $((SECONDS - start)) s"
    tail -n 4 "$out/$name.log" | cut -c1-3000
}
