"""Programs by name: what a command name means to the policy, and the lists it refuses outright."""

from __future__ import annotations

import posixpath
import re

SHELLS = frozenset({"sh", "bash", "rbash", "zsh", "dash", "ksh", "ksh93", "mksh", "pdksh", "oksh", "lksh",
                    "loksh", "ash", "hush", "yash", "posh", "fish", "csh", "tcsh", "es", "rc", "elvish", "nu",
                    "nushell", "xonsh", "osh", "ysh"})  # fmt: skip
# other languages, by the family whose code checks apply (interpreters.py, code.py)
LANGUAGES = {
    **dict.fromkeys(["python", "pypy", "ipython", "jython", "micropython", "graalpy"], "python"),
    **dict.fromkeys(["perl", "cperl"], "perl"),
    **dict.fromkeys(["ruby", "jruby", "truffleruby", "irb"], "ruby"),
    **dict.fromkeys(["node", "nodejs", "deno", "bun", "ts-node", "tsx", "qjs", "js"], "node"),
    **dict.fromkeys(["php", "php-cli"], "php"),
    **dict.fromkeys(["lua", "luajit", "texlua"], "lua"),
    **dict.fromkeys(["tclsh", "wish", "expect", "jimsh"], "tcl"),
    **dict.fromkeys(["Rscript", "R"], "r"),
    **dict.fromkeys(["julia"], "julia"),
    **dict.fromkeys(["osascript"], "applescript"),
    **dict.fromkeys(["pwsh", "powershell"], "powershell"),
    **dict.fromkeys(["awk", "gawk", "mawk", "nawk", "original-awk", "goawk"], "awk"),
    **dict.fromkeys(["dc"], "dc"),
    **dict.fromkeys(["groovy", "scala", "kotlin", "elixir", "erl", "escript", "racket", "guile", "sbcl", "clojure",
                     "swift", "ghci", "runghc", "gst", "pike", "crystal", "nim", "janet", "gnuplot"],
                    "other"),
}  # fmt: skip
INTERPRETERS = SHELLS | frozenset(LANGUAGES)
_VERSIONED = re.compile(r"(?P<base>[A-Za-z][A-Za-z_-]*?[A-Za-z])-?(?:\d+(?:\.\d+)*[a-z]?)?(?:-(?:dbg|debug|cli))?")

PRIVILEGE = frozenset({"sudo", "su", "doas", "pkexec", "runuser", "sudoedit", "setpriv", "capsh", "chroot",
                       "nsenter", "unshare", "setcap", "filecap", "sg", "newgrp", "gosu", "su-exec", "run0",
                       "systemd-run", "machinectl", "ksu", "pfexec", "dzdo", "pbrun", "calife", "super",
                       "start-stop-daemon", "pivot_root", "switch_root", "chpst"})  # fmt: skip
FORBIDDEN = {  # name -> why
    **dict.fromkeys(["chown", "chgrp", "lchown"], "changes file ownership"),
    **dict.fromkeys(["fdisk", "sfdisk", "cfdisk", "gdisk", "sgdisk", "cgdisk", "parted", "partprobe", "wipefs",
                     "mkswap", "mke2fs", "badblocks", "blkdiscard", "hdparm", "sdparm", "nvme", "sg_format",
                     "flashrom", "mdadm", "cryptsetup", "dmsetup", "losetup", "lvremove", "vgremove", "pvremove",
                     "lvcreate", "vgcreate", "pvcreate", "lvresize", "lvextend", "lvreduce", "zpool", "zfs",
                     "debugfs", "tune2fs", "e2fsck", "fsck", "xfs_repair", "btrfs", "resize2fs", "e4defrag",
                     "mkdosfs", "mlabel", "dosfsck", "growpart", "kpartx", "blockdev", "wipe", "scrub"],
                    "rewrites disks, partitions or filesystems"),
    **dict.fromkeys(["shutdown", "reboot", "halt", "poweroff", "init", "telinit", "killall5", "kexec",
                     "pm-suspend", "pm-hibernate", "rtcwake"], "stops or restarts the machine"),
    **dict.fromkeys(["useradd", "userdel", "usermod", "groupadd", "groupdel", "groupmod", "passwd", "chpasswd",
                     "visudo", "adduser", "deluser", "addgroup", "delgroup", "chsh", "chfn", "gpasswd", "newusers",
                     "vipw", "vigr", "chage", "pwconv", "grpconv"], "changes accounts"),
    **dict.fromkeys(["iptables", "ip6tables", "iptables-restore", "ip6tables-restore", "iptables-legacy",
                     "iptables-nft", "nft", "ufw", "firewall-cmd", "ebtables", "arptables", "pfctl"],
                    "changes the firewall"),
    **dict.fromkeys(["insmod", "rmmod", "modprobe", "depmod", "mount", "umount", "swapon", "swapoff", "dkms",
                     "ldconfig", "update-grub", "grub-install", "grub-mkconfig", "efibootmgr", "update-initramfs",
                     "mkinitcpio", "dracut", "update-alternatives", "alternatives", "setenforce", "setsebool",
                     "semanage", "aa-disable", "aa-complain", "apparmor_parser", "auditctl"],
                    "changes the kernel, boot, mounts or security modules"),
    **dict.fromkeys(["at", "batch", "update-rc.d", "chkconfig", "rc-update", "launchctl", "initctl"],
                    "schedules commands or changes services"),
}  # fmt: skip
NETWORK = frozenset({"curl", "wget", "nc", "ncat", "netcat", "socat", "telnet", "ssh", "scp", "sftp", "rsync",
                     "ftp", "lftp", "tftp", "http", "https", "xh", "httpie", "aria2c", "axel", "dig",
                     "nslookup", "host", "drill", "ping", "mail", "mailx", "sendmail", "mutt", "msmtp", "swaks",
                     "aws", "gsutil", "gcloud", "az", "rclone", "s3cmd", "gh", "smbclient", "websocat",
                     "cryptcat", "ssh-copy-id", "fetch", "lwp-request", "lwp-download", "pwncat", "nmap",
                     "torify", "proxychains", "proxychains4"})  # fmt: skip
RELAYS = frozenset({"nc", "ncat", "netcat", "socat", "telnet", "cryptcat", "websocat", "pwncat"})
DOWNLOADERS = frozenset({"curl", "wget", "aria2c", "axel", "http", "https", "xh", "fetch", "lwp-download",
                         "lwp-request", "tftp"})  # fmt: skip
# commands that only look at what they are given: an output-like option or a raw disk among their arguments is
# not a write
INSPECTORS = frozenset({"ls", "cat", "less", "more", "head", "tail", "grep", "egrep", "fgrep", "rg", "ag", "wc",
                        "stat", "file", "du", "df", "find", "fd", "diff", "cmp", "md5sum", "sha1sum", "sha256sum",
                        "sha512sum", "b2sum", "cksum", "test", "[", "[[", "echo", "printf", "lsblk", "blkid",
                        "findmnt", "udevadm", "smartctl", "readlink", "realpath", "basename", "dirname", "namei",
                        "lsof", "fuser", "ps", "pgrep", "id", "getfacl", "lsattr", "xxd", "hexdump", "od",
                        "strings", "nm", "objdump", "readelf", "ldd", "tree", "jq", "yq", "column", "cut", "tr",
                        "sort", "uniq", "comm", "join", "paste", "nl", "fold", "fmt", "expand", "unexpand", "rev",
                        "tac", "type", "which", "whereis", "command", "true", "false", ":"})  # fmt: skip
# programs whose output the shell may evaluate: `eval "$(ssh-agent -s)"`, `source <(kubectl completion bash)`
ENV_PRINTERS = frozenset({"ssh-agent", "pyenv", "rbenv", "nodenv", "goenv", "jenv", "plenv", "direnv", "conda",
                          "mamba", "micromamba", "minikube", "opam", "brew", "dircolors", "keychain", "zoxide",
                          "starship", "fnm", "mise", "rtx", "kubectl", "helm", "gh", "pip", "pipx", "poetry",
                          "register-python-argcomplete", "docker-machine", "luarocks", "fzf", "rustup", "uv",
                          "npm", "pnpm", "atuin", "thefuck", "gpg-agent", "ssh-add", "kind", "k3d", "terraform",
                          "aws_completer", "oh-my-posh", "navi", "volta"})  # fmt: skip


ALIASES = {"nc.traditional": "nc", "nc.openbsd": "nc", "netcat.traditional": "nc", "netcat.openbsd": "nc",
           "ncat.exe": "ncat", "fdfind": "fd", "rg.exe": "rg"}  # fmt: skip


def program(word: str) -> str:
    """The program a command name runs: its file name, with a version suffix dropped for an interpreter
    (`/usr/bin/python3.11` -> python, `perl5.36` -> perl, `bash5` -> bash)."""
    name = posixpath.basename(word.rstrip("/")) if "/" in word else word
    name = ALIASES.get(name, name)
    if name in INTERPRETERS:
        return name
    m = _VERSIONED.fullmatch(name)
    if m is not None and m.group("base") in INTERPRETERS:
        return m.group("base")
    return name


def language(name: str) -> str | None:
    """The interpreter family: "shell", "python", "perl", ...; None for another program."""
    if name in SHELLS:
        return "shell"
    return LANGUAGES.get(name)
