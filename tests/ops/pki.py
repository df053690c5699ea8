"""A throwaway PKI for the ops TLS tests, made with the openssl command line (the same files as
common/testing/pki.h): ca and other-ca; server (IP:127.0.0.1, DNS:localhost) and client
(clientAuth) signed by ca; stranger (the server's names) signed by other-ca."""
import subprocess

SCRIPT = (
    "set -e; "
    "key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out $1; }; "
    "ca() { key $1.key; openssl req -x509 -new -key $1.key -out $1.pem -days 2 -subj /CN=$1; }; "
    "leaf() { key $1.key; openssl req -new -key $1.key -out $1.csr -subj /CN=$1; "
    "printf '%s\\n' \"$3\" > $1.ext; "
    "openssl x509 -req -in $1.csr -CA $2.pem -CAkey $2.key -CAcreateserial -out $1.pem "
    "-days 2 -extfile $1.ext; }; "
    "ca ca; ca other-ca; "
    "leaf server ca 'subjectAltName=IP:127.0.0.1,DNS:localhost'; "
    "leaf client ca 'extendedKeyUsage=clientAuth'; "
    "leaf stranger other-ca 'subjectAltName=IP:127.0.0.1,DNS:localhost'")


def have_openssl():
    return subprocess.run(["sh", "-c", "command -v openssl"], capture_output=True).returncode == 0


def make_pki(directory):
    """Makes the files in `directory`; returns (ok, openssl's stderr tail)."""
    r = subprocess.run(["sh", "-c", SCRIPT], cwd=directory, capture_output=True, text=True)
    return r.returncode == 0, r.stderr[-500:]
