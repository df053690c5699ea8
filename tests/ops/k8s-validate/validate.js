#!/usr/bin/env node
// Checks deploy/kubernetes/*.yaml (ctest ops_kubernetes_schema, docs/operations.md "Kubernetes"):
//
// Schema, against Kubernetes 1.33.0 (kubernetes-models 4.5.1, whose schemas are generated from that
// release's OpenAPI spec; versions pinned in package.json + package-lock.json here):
//   - every document parses (duplicate keys refused), its apiVersion is a GA group version that
//     1.33 serves and its kind one of that group version's kinds, and it has metadata.name;
//   - the JSON schema of its kind (kubernetes-models' validate()): required fields, types, enums,
//     formats (quantities, int32, ...);
//   - no unknown fields, at any depth: the document, as an object literal, type-checked by the
//     TypeScript compiler against the package's declaration of its kind (excess properties are
//     errors); the schema alone allows unknown fields, as the API server did before strict
//     field validation.
// Consistency with docker/ (the images the manifests run):
//   - every image is one a docker/Dockerfile.* builds, by the tag its header or docker/README.md
//     gives it (no tag = :latest);
//   - what each container runs (command, or the image's ENTRYPOINT; args) is installed in that
//     image: the final stage's files (install/cp into the build stage's /out, copied to /) and
//     its Debian packages' files (dpkg-query -L on this machine); absolute paths in
//     command/args must be in the image or under one of the container's volume mounts;
//   - nvidia.com/gpu is requested only by containers of the train Job, only where the image has
//     CUDA (a CUDA PyTorch or runtime), and only when the pod's agent image has the CUDA stager
//     plugin (libposeidon_cuda_stager.so), and its requests equal its limits;
//   - selectors match their pod templates, Services select some pod, named ports exist.
//
// Usage: node validate.js --modules DIR --root REPO [--self-test]
//   DIR holds node_modules (npm ci of this directory's package-lock.json).
//   --self-test: check deliberately broken copies of the manifests and Dockerfiles (each must
//   fail with the expected message) and one valid GPU variant (must pass); then the real files.
"use strict";

const fs = require("fs");
const os = require("os");
const path = require("path");
const { createRequire } = require("module");
const { execFileSync } = require("child_process");

const K8S_VERSION = "1.33.0";
const PINNED = { "kubernetes-models": "4.5.1", "js-yaml": "4.1.0", typescript: "5.9.3" };
// The GA group versions Kubernetes 1.33 serves by default (kubernetes-models also carries
// removed ones such as extensions/v1beta1, which a 1.33 API server refuses).
const SERVED = new Set([
  "v1", "apps/v1", "batch/v1", "autoscaling/v1", "autoscaling/v2", "policy/v1",
  "networking.k8s.io/v1", "rbac.authorization.k8s.io/v1", "storage.k8s.io/v1",
  "scheduling.k8s.io/v1", "coordination.k8s.io/v1", "discovery.k8s.io/v1", "node.k8s.io/v1",
  "certificates.k8s.io/v1", "admissionregistration.k8s.io/v1", "apiextensions.k8s.io/v1",
  "apiregistration.k8s.io/v1", "events.k8s.io/v1", "flowcontrol.apiserver.k8s.io/v1",
]);
const GPU = "nvidia.com/gpu";
const PATH_DIRS = ["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"];

function parseArgs(argv) {
  const a = { selfTest: false };
  for (let i = 0; i < argv.length; i++) {
    if (argv[i] === "--modules") a.modules = argv[++i];
    else if (argv[i] === "--root") a.root = argv[++i];
    else if (argv[i] === "--self-test") a.selfTest = true;
    else throw new Error(`unknown argument ${argv[i]}`);
  }
  if (!a.modules || !a.root) throw new Error("usage: validate.js --modules DIR --root REPO [--self-test]");
  return a;
}

const args = parseArgs(process.argv.slice(2));
const req = createRequire(path.join(path.resolve(args.modules), "package.json"));
for (const [name, want] of Object.entries(PINNED)) {
  const got = JSON.parse(fs.readFileSync(path.join(args.modules, "node_modules", name, "package.json"))).version;
  if (got !== want) {
    console.error(`FAIL: ${name} ${got} installed in ${args.modules}, ${want} pinned (npm ci again)`);
    process.exit(1);
  }
}
const yaml = req("js-yaml");
const ts = req("typescript");

// ---------------------------------------------------------------- manifests

function loadManifests(root) {
  const dir = path.join(root, "deploy", "kubernetes");
  const docs = [];
  const errors = [];
  for (const f of fs.readdirSync(dir).filter((n) => n.endsWith(".yaml")).sort()) {
    let parsed;
    try {
      parsed = yaml.loadAll(fs.readFileSync(path.join(dir, f), "utf8"), null, { filename: f });
    } catch (e) {
      errors.push(`${f}: YAML: ${e.message.split("\n")[0]}`);
      continue;
    }
    parsed.forEach((doc, index) => {
      if (doc === null || doc === undefined) return;
      docs.push({ file: f, index, doc, where: `${f}#${index} ${doc.kind}/${(doc.metadata && doc.metadata.name) || "?"}` });
    });
  }
  return { docs, errors };
}

function modelOf(doc) {
  const av = doc.apiVersion;
  const kind = doc.kind;
  if (typeof av !== "string" || typeof kind !== "string") return { error: "no apiVersion or kind" };
  if (!SERVED.has(av)) return { error: `apiVersion ${av} is not a group version Kubernetes ${K8S_VERSION} serves` };
  if (!/^[A-Z][A-Za-z0-9]*$/.test(kind)) return { error: `unknown kind ${kind} in ${av}` };
  const spec = `kubernetes-models/${av}/${kind}`;
  let mod;
  try {
    mod = req(spec);
  } catch (e) {
    return { error: `unknown kind ${kind} in ${av} (Kubernetes ${K8S_VERSION})` };
  }
  const cls = mod[kind];
  if (!cls || cls.apiVersion !== av || cls.kind !== kind) {
    return { error: `unknown kind ${kind} in ${av} (Kubernetes ${K8S_VERSION}; not a top-level object)` };
  }
  return { cls, spec };
}

function schemaErrors(docs) {
  const errors = [];
  const typed = [];
  for (const d of docs) {
    const m = modelOf(d.doc);
    if (m.error) {
      errors.push(`${d.where}: ${m.error}`);
      continue;
    }
    if (!d.doc.metadata || typeof d.doc.metadata.name !== "string" || !d.doc.metadata.name) {
      errors.push(`${d.where}: metadata.name is required`);
    }
    try {
      new m.cls(d.doc).validate();
    } catch (e) {
      for (const x of e.errors || [{ instancePath: "", message: e.message }]) {
        if (x.keyword === "oneOf") continue; // the branches' own errors say it
        const extra = x.params && x.params.allowedValues ? ` (${x.params.allowedValues.join(", ")})` : "";
        errors.push(`${d.where}: ${x.instancePath || "/"} ${x.message}${extra}`);
      }
    }
    typed.push({ d, spec: m.spec, kind: d.doc.kind });
  }
  errors.push(...unknownFieldErrors(typed));
  return errors;
}

const declarations = new Map();

// Every document as `export const docN: I<Kind> = {...}` type-checked by TypeScript: an unknown
// field anywhere is an excess property of an object literal.
function unknownFieldErrors(typed) {
  if (typed.length === 0) return [];
  const imports = new Map();
  let src = "";
  typed.forEach((t, i) => {
    if (!imports.has(t.spec)) imports.set(t.spec, `T${imports.size}`);
    src += `export const doc${i}: ${imports.get(t.spec)} = ${JSON.stringify(t.d.doc, null, 2)};\n`;
  });
  src = [...imports].map(([spec, alias]) => {
    const kind = spec.split("/").pop();
    return `import type { I${kind} as ${alias} } from "${spec}";\n`;
  }).join("") + src;
  const file = path.join(path.resolve(args.modules), "manifests-check.ts");
  const host = ts.createCompilerHost({});
  const original = host.getSourceFile;
  let sf;
  host.getSourceFile = (f, lang, ...rest) => {
    if (path.resolve(f) === file) return (sf = ts.createSourceFile(f, src, lang, true));
    if (!declarations.has(f)) declarations.set(f, original.call(host, f, lang, ...rest));
    return declarations.get(f); // the package's .d.ts files, parsed once per run
  };
  host.fileExists = ((exists) => (f) => path.resolve(f) === file || exists(f))(host.fileExists.bind(host));
  const program = ts.createProgram([file], {
    strict: true, noEmit: true, skipLibCheck: true, types: [],
    module: ts.ModuleKind.CommonJS, moduleResolution: ts.ModuleResolutionKind.Node10,
  }, host);
  const errors = [];
  for (const diag of ts.getPreEmitDiagnostics(program)) {
    const text = ts.flattenDiagnosticMessageText(diag.messageText, "; ");
    if (!diag.file || path.resolve(diag.file.fileName) !== file) {
      errors.push(`TypeScript: ${text}`);
      continue;
    }
    const { where, at } = locate(diag.file, diag.start, typed);
    errors.push(`${where}: ${at}: ${text.replace(/'"([^"']+)"'/g, "'$1'")}`);
  }
  if (!sf) errors.push("TypeScript: the generated check was not compiled");
  return errors;
}

// The document and the field path (spec.template.spec.containers[1].bogus) at a position.
function locate(sf, pos, typed) {
  let node = sf;
  for (;;) {
    const child = node.getChildren(sf).find((c) => c.getStart(sf) <= pos && pos < c.getEnd());
    if (!child) break;
    node = child;
  }
  const parts = [];
  let docIndex = -1;
  for (let n = node; n; n = n.parent) {
    if (ts.isPropertyAssignment(n)) parts.unshift(n.name.text !== undefined ? n.name.text : n.name.getText(sf));
    if (n.parent && ts.isArrayLiteralExpression(n.parent)) parts.unshift(`[${n.parent.elements.indexOf(n)}]`);
    if (ts.isVariableDeclaration(n)) docIndex = Number(n.name.getText(sf).slice(3));
  }
  const where = docIndex >= 0 ? typed[docIndex].d.where : "?";
  return { where, at: parts.join(".").replace(/\.\[/g, "[") || "/" };
}

// ---------------------------------------------------------------- images

function logicalLines(text) {
  return text.replace(/\\\n/g, " ").split("\n").map((l) => l.trim()).filter((l) => l && !l.startsWith("#"));
}

// This machine's dpkg database (Debian 12, as the images): each installed package's dependencies,
// to know the files an image's `apt-get install` brings with what it depends on.
let dpkgDb = null;
function dpkg() {
  if (dpkgDb) return dpkgDb;
  dpkgDb = { deps: new Map(), provides: new Map(), base: [], files: new Map() };
  let out = "";
  try {
    out = execFileSync("dpkg-query", ["-W", "-f", "${Package}\t${Essential}\t${Priority}\t${Pre-Depends}, ${Depends}\t${Provides}\t${db:Status-Abbrev}\n"],
      { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"], maxBuffer: 64 << 20 });
  } catch (e) {
    return dpkgDb; // no dpkg: packages count by their names only
  }
  const name = (d) => d.trim().split(/[\s(:]/)[0];
  for (const line of out.split("\n")) {
    const [pkg, essential, priority, deps, provides, status] = line.split("\t");
    if (!pkg || !status || !status.startsWith("ii")) continue;
    dpkgDb.deps.set(pkg, deps.split(",").map((d) => d.split("|").map(name).filter(Boolean)).filter((a) => a.length));
    for (const v of provides.split(",").map(name).filter(Boolean)) {
      if (!dpkgDb.provides.has(v)) dpkgDb.provides.set(v, pkg);
    }
    if (essential === "yes" || priority === "required") dpkgDb.base.push(pkg);
  }
  return dpkgDb;
}

// The files of packages and of everything they depend on (installed here); names not installed
// here come back in `unresolved`.
function packageClosure(pkgs, withBase) {
  const db = dpkg();
  const seen = new Set();
  const unresolved = [];
  const todo = [...pkgs.map((p) => [p, true]), ...(withBase ? db.base.map((p) => [p, false]) : [])];
  while (todo.length) {
    const [p, direct] = todo.pop();
    const real = db.deps.has(p) ? p : db.provides.get(p);
    if (!real) {
      if (direct) unresolved.push(p);
      continue;
    }
    if (seen.has(real)) continue;
    seen.add(real);
    for (const alts of db.deps.get(real)) {
      const hit = alts.find((a) => db.deps.has(a) || db.provides.has(a));
      if (hit) todo.push([hit, false]);
    }
  }
  const files = [];
  for (const p of seen) {
    if (db.files.has(p)) continue;
    let out = "";
    try {
      out = execFileSync("dpkg-query", ["-L", p], { encoding: "utf8", stdio: ["ignore", "pipe", "ignore"], maxBuffer: 64 << 20 });
    } catch (e) {
      out = "";
    }
    db.files.set(p, out.split("\n").filter((l) => l.startsWith("/")));
  }
  for (const p of seen) files.push(...db.files.get(p));
  return { files, unresolved };
}

function parseDockerfile(file, text) {
  const stages = [];
  for (const line of logicalLines(text)) {
    const m = /^(\S+)\s+(.*)$/.exec(line);
    if (!m) continue;
    const instr = m[1].toUpperCase();
    const rest = m[2];
    if (instr === "FROM") {
      const f = /^(?:--\S+\s+)*(\S+)(?:\s+AS\s+(\S+))?/i.exec(rest);
      stages.push({ base: f[1], name: f[2] || String(stages.length), lines: [] });
    } else if (stages.length) {
      stages[stages.length - 1].lines.push({ instr, rest });
    }
  }
  const img = {
    file, files: new Set(), packages: [], unresolved: [], entrypoint: null, cmd: null,
    user: null, base: null, text,
  };
  if (stages.length === 0) return img;
  const final = stages[stages.length - 1];
  img.base = final.base;
  const outFiles = (stage) => {
    // Files a build stage writes under /out: `install ... SRC /out/PATH`, `cp -r SRC /out/DIR/`.
    const out = [];
    for (const l of stage.lines.filter((x) => x.instr === "RUN")) {
      for (const cmd of l.rest.split(/&&|;/)) {
        const w = cmd.trim().split(/\s+/);
        const dests = w.filter((x) => x.startsWith("/out/"));
        if (w[0] === "install" && !w.includes("-d")) {
          out.push(...dests.map((x) => x.slice(4)));
        } else if (w[0] === "cp" && dests.length) {
          const src = w.filter((x) => !x.startsWith("-"))[1];
          const dst = dests[dests.length - 1].slice(4);
          out.push(dst.endsWith("/") ? dst + path.basename(src) : dst);
          out.push(...dirTree(path.join(args.root, src)).map((rel) => path.join(dst.endsWith("/") ? dst + path.basename(src) : dst, rel)));
        }
      }
    }
    return out;
  };
  for (const l of final.lines) {
    if (l.instr === "COPY") {
      const w = l.rest.split(/\s+/);
      const from = w.find((x) => x.startsWith("--from="));
      const plain = w.filter((x) => !x.startsWith("--"));
      if (from) {
        const stage = stages.find((s) => s.name === from.slice(7));
        const [src, dst] = plain;
        // `COPY --from=build /out/ /` or one image's part of a shared build stage, `/out/<name>/`.
        const dir = src.replace(/\/$/, "");
        if (stage && (dir === "/out" || dir.startsWith("/out/"))) {
          const sub = dir.slice("/out".length);
          for (const f of outFiles(stage)) {
            if (sub === "" || f.startsWith(sub + "/")) img.files.add(path.posix.join(dst, f.slice(sub.length)));
          }
        } else {
          img.files.add(dst.endsWith("/") ? dst + path.basename(src) : dst);
        }
      } else if (plain.length >= 2) {
        const dst = plain[plain.length - 1];
        for (const src of plain.slice(0, -1)) img.files.add(dst.endsWith("/") ? dst + path.basename(src) : dst);
      }
    } else if (l.instr === "RUN") {
      for (const cmd of l.rest.split(/&&|;|\|\|/)) {
        const w = cmd.trim().split(/\s+/);
        const i = w.indexOf("install");
        if (/apt-get$|^apt$/.test(w.find((x) => !/=/.test(x)) || "") && i > 0) {
          img.packages.push(...w.slice(i + 1).filter((x) => !x.startsWith("-")));
        }
        if (w[0] === "install" && w.includes("-d")) {
          w.filter((x) => x.startsWith("/")).forEach((d) => img.files.add(d));
        }
      }
    } else if (l.instr === "ENTRYPOINT") {
      img.entrypoint = execForm(l.rest);
    } else if (l.instr === "CMD") {
      img.cmd = execForm(l.rest);
    } else if (l.instr === "USER") {
      img.user = l.rest.trim();
    } else if (l.instr === "WORKDIR") {
      img.files.add(l.rest.trim());
    }
  }
  const fromDebian = /^debian:/.test(final.base);
  const closure = packageClosure(img.packages.filter((p) => !/^[./]/.test(p)), fromDebian);
  closure.files.forEach((f) => img.files.add(f));
  img.unresolved = closure.unresolved.concat(img.packages.filter((p) => /^[./]/.test(p)));
  const base = (f) => f.slice(f.lastIndexOf("/") + 1);
  const files = [...img.files];
  img.cudaPlugin = files.some((f) => base(f) === "libposeidon_cuda_stager.so") ||
    img.packages.some((p) => /^(\.\/)?poseidon-agent-cuda\b/.test(base(p)));
  img.cuda = img.cudaPlugin || files.some((f) => /^lib(cudart|cublas)\.so/.test(base(f))) ||
    img.packages.some((p) => /^(python3-torch-cuda|nvidia-cuda-|libcudart|cuda-)/.test(p)) ||
    /(^|\/)(nvidia\/cuda|cuda)(:|$)/.test(final.base) ||
    /pip3? install[^\n]*torch[^\n]*download\.pytorch\.org\/whl\/cu\d+/.test(text);
  return img;
}

function dirTree(dir) {
  const out = [];
  const walk = (d, rel) => {
    let entries = [];
    try { entries = fs.readdirSync(d, { withFileTypes: true }); } catch (e) { return; }
    for (const e of entries) {
      out.push(path.posix.join(rel, e.name));
      if (e.isDirectory()) walk(path.join(d, e.name), path.posix.join(rel, e.name));
    }
  };
  walk(dir, "");
  return out;
}

function execForm(rest) {
  try {
    const v = JSON.parse(rest);
    if (Array.isArray(v)) return v;
  } catch (e) { /* shell form */ }
  return ["/bin/sh", "-c", rest];
}

function normalizeImage(ref) {
  const lastSlash = ref.lastIndexOf("/");
  return ref.indexOf(":", lastSlash + 1) >= 0 || ref.includes("@") ? ref : `${ref}:latest`;
}

// docker/Dockerfile.* and the tags they are built with (`-t NAME[:TAG]` in the file's header
// and in docker/README.md, where `$i` of a `for i in ...` loop stands for each suffix).
function loadImages(root) {
  const dir = path.join(root, "docker");
  const images = new Map();
  const files = fs.readdirSync(dir).filter((n) => /^Dockerfile\.[A-Za-z0-9_-]+$/.test(n)).sort();
  let readme = "";
  try { readme = fs.readFileSync(path.join(dir, "README.md"), "utf8"); } catch (e) { /* none */ }
  for (const f of files) {
    const text = fs.readFileSync(path.join(dir, f), "utf8");
    const img = parseDockerfile(f, text);
    const suffix = f.slice("Dockerfile.".length);
    const tags = new Set();
    for (const m of text.matchAll(new RegExp(`-f\\s+docker/${f.replace(".", "\\.")}\\s+-t\\s+(\\S+)`, "g"))) tags.add(m[1]);
    for (const loop of readme.matchAll(/for\s+(\w+)\s+in\s+([^;]+);\s*do\s+[^\n]*-f\s+docker\/Dockerfile\.\$\1\s+-t\s+(\S+)/g)) {
      if (loop[2].trim().split(/\s+/).includes(suffix)) tags.add(loop[3].replace(`$${loop[1]}`, suffix));
    }
    for (const t of tags) images.set(normalizeImage(t), img);
  }
  return images;
}

// ---------------------------------------------------------------- consistency

function podOf(doc) {
  const spec = doc.spec || {};
  if (doc.kind === "Pod") return { pod: spec, labels: (doc.metadata || {}).labels || {} };
  if (spec.template && spec.template.spec) {
    return { pod: spec.template.spec, labels: (spec.template.metadata || {}).labels || {} };
  }
  if (spec.jobTemplate && spec.jobTemplate.spec && spec.jobTemplate.spec.template) {
    const t = spec.jobTemplate.spec.template;
    return { pod: t.spec || {}, labels: (t.metadata || {}).labels || {} };
  }
  return null;
}

// Debian 12 has a merged /usr: /bin, /sbin, /lib are links into /usr.
function installed(img, file) {
  const merged = file.replace(/^\/usr\/(bin|sbin|lib)\//, "/$1/");
  return img.files.has(file) || img.files.has(merged) || img.files.has(merged.replace(/^\/(bin|sbin|lib)\//, "/usr/$1/"));
}

function resolveExe(img, exe) {
  if (exe.startsWith("/")) return installed(img, exe) ? exe : null;
  for (const d of PATH_DIRS) if (installed(img, `${d}/${exe}`)) return `${d}/${exe}`;
  if (img.unresolved.includes(exe)) return `(package ${exe})`; // not installed here: its name
  return null;
}

const notes = new Set();
const quantity = (v) => (v === undefined ? undefined : String(v));

function consistencyErrors(docs, images) {
  const errors = [];
  const pods = [];
  for (const d of docs) {
    const p = podOf(d.doc);
    if (p) pods.push({ d, ...p });
  }
  for (const { d, pod, labels } of pods) {
    const sel = (d.doc.spec || {}).selector;
    for (const [k, v] of Object.entries((sel && sel.matchLabels) || {})) {
      if (labels[k] !== v) errors.push(`${d.where}: selector ${k}=${v} does not match the pod template's labels`);
    }
    const containers = [...(pod.initContainers || []), ...(pod.containers || [])];
    const agentImages = (pod.containers || []).filter((c) => c.name === "agent").map((c) => images.get(normalizeImage(c.image || "")));
    const mounts = (c) => (c.volumeMounts || []).map((m) => m.mountPath.replace(/\/$/, ""));
    for (const c of containers) {
      const where = `${d.where}: container ${c.name}`;
      const img = images.get(normalizeImage(c.image || ""));
      if (!img) {
        errors.push(`${where}: image ${c.image} is not built by docker/ (built: ${[...images.keys()].join(", ")})`);
      }
      const portNames = new Set((c.ports || []).map((p) => p.name).filter(Boolean));
      for (const probe of ["livenessProbe", "readinessProbe", "startupProbe"]) {
        const pr = c[probe];
        const port = pr && ((pr.httpGet || {}).port || (pr.tcpSocket || {}).port || (pr.grpc || {}).port);
        if (typeof port === "string" && !portNames.has(port)) errors.push(`${where}: ${probe} names no port of the container: ${port}`);
      }
      const res = c.resources || {};
      const lim = quantity((res.limits || {})[GPU]);
      const rq = quantity((res.requests || {})[GPU]);
      if (rq !== undefined && rq !== lim) errors.push(`${where}: ${GPU} requests ${rq} must equal its limits (${lim === undefined ? "none" : lim})`);
      if ((lim !== undefined && lim !== "0") || (rq !== undefined && rq !== "0")) {
        if (d.doc.kind !== "Job") {
          errors.push(`${where}: requests ${GPU}, but only the train Job's containers use GPUs`);
        } else if (img && !img.cuda) {
          errors.push(`${where}: requests ${GPU}, but image ${c.image} (docker/${img.file}) has no CUDA ` +
                      `(Debian's python3-torch is a CPU build; no CUDA runtime or stager plugin)`);
        } else if (img && !agentImages.some((a) => a && a.cudaPlugin)) {
          errors.push(`${where}: requests ${GPU}, but the pod's agent image has no CUDA stager plugin ` +
                      `(libposeidon_cuda_stager.so), so the agent cannot stage its GPU gradients`);
        }
      }
      if (!img) continue;
      if (img.unresolved.length) {
        // Not fatal: a package this machine does not have installed counts by its name only.
        const note = `note: docker/${img.file}: packages not installed here, counted by name: ${img.unresolved.join(" ")}`;
        if (!notes.has(note)) console.log(note);
        notes.add(note);
      }
      const argv = c.command ? [...c.command, ...(c.args || [])] :
        [...(img.entrypoint || []), ...(c.args || (img.entrypoint ? [] : img.cmd || []))];
      if (argv.length === 0) {
        errors.push(`${where}: runs nothing: no command and image ${c.image} has no ENTRYPOINT or CMD`);
        continue;
      }
      if (!resolveExe(img, argv[0])) {
        errors.push(`${where}: runs ${argv[0]}, which image ${c.image} (docker/${img.file}) does not install`);
      }
      for (const a of argv.slice(1)) {
        if (!a.startsWith("/") || a.includes("$(")) continue;
        const p = a.replace(/\/$/, "");
        const underMount = mounts(c).some((m) => p === m || p.startsWith(m + "/"));
        if (!underMount && !installed(img, p)) {
          errors.push(`${where}: argument ${a} is neither in image ${c.image} (docker/${img.file}) nor under a volume mount of the container`);
        }
      }
    }
  }
  // A Service selects the pods of some workload.
  for (const d of docs.filter((x) => x.doc.kind === "Service")) {
    const sel = (d.doc.spec || {}).selector;
    if (!sel) continue;
    const ns = (d.doc.metadata || {}).namespace;
    const hit = pods.filter(({ d: w, labels }) => (w.doc.metadata || {}).namespace === ns &&
      Object.entries(sel).every(([k, v]) => labels[k] === v));
    if (hit.length === 0) {
      errors.push(`${d.where}: its selector matches no pod template`);
      continue;
    }
    for (const port of (d.doc.spec.ports || [])) {
      if (typeof port.targetPort !== "string") continue;
      const named = hit.some(({ pod }) => (pod.containers || []).some((c) => (c.ports || []).some((p) => p.name === port.targetPort)));
      if (!named) errors.push(`${d.where}: targetPort ${port.targetPort} is no container port of the pods it selects`);
    }
  }
  return errors;
}

function check(root) {
  const { docs, errors } = loadManifests(root);
  errors.push(...schemaErrors(docs));
  errors.push(...consistencyErrors(docs, loadImages(root)));
  return { docs, errors };
}

// ---------------------------------------------------------------- self-test

function copyTree(src, dst) {
  fs.mkdirSync(dst, { recursive: true });
  for (const e of fs.readdirSync(src, { withFileTypes: true })) {
    const s = path.join(src, e.name);
    const t = path.join(dst, e.name);
    if (e.isDirectory()) copyTree(s, t);
    else if (e.isFile()) fs.copyFileSync(s, t);
  }
}

function edit(file, from, to) {
  const text = fs.readFileSync(file, "utf8");
  if (!text.includes(from)) throw new Error(`self-test: ${path.basename(file)} no longer contains ${JSON.stringify(from)}`);
  fs.writeFileSync(file, text.replace(from, to));
}

const COORD = "deploy/kubernetes/10-coordinator.yaml";
const SERVERS = "deploy/kubernetes/20-servers.yaml";
const JOB = "deploy/kubernetes/30-training-job.yaml";
const NS = "deploy/kubernetes/00-namespace-secrets.yaml";
const CASES = [
  { what: "unknown field in a container", file: JOB, from: "          image: poseidon/agent:latest\n",
    to: "          image: poseidon/agent:latest\n          imagePullPolcy: Never\n",
    want: /containers\[0\]\.imagePullPolcy: Object literal may only specify known properties/ },
  { what: "unknown top-level field", file: COORD, from: "kind: Deployment\n", to: "kind: Deployment\nstatu: {}\n",
    want: /Deployment\/poseidon-coordinator: statu: .*known properties/ },
  { what: "unknown field under the pod template", file: SERVERS, from: "      terminationGracePeriodSeconds: 60\n",
    to: "      terminationGracePeriod: 60\n", want: /template\.spec\.terminationGracePeriod: .*known properties/ },
  { what: "wrong type (port as a string)", file: COORD, from: "containerPort: 7070}", to: "containerPort: \"7070\"}",
    want: /containerPort must be integer/ },
  { what: "bad quantity", file: SERVERS, from: "memory: 8Gi}", to: "memory: 8 GiB}", want: /requests\/memory must match format "quantity"/ },
  { what: "bad enum", file: COORD, from: "type: Recreate", to: "type: Recreat", want: /strategy\/type must be equal to one of the allowed values/ },
  { what: "required field missing (container name)", file: JOB, from: "        - name: trainer\n          image:",
    to: "        - image:", want: /must have required property name/ },
  { what: "required field missing (metadata.name)", file: NS, from: "  name: poseidon\n  labels:", to: "  labels:",
    want: /metadata\.name is required/ },
  { what: "unknown kind", file: COORD, from: "kind: Deployment", to: "kind: Deploymnet", want: /unknown kind Deploymnet in apps\/v1/ },
  { what: "removed apiVersion", file: COORD, from: "apiVersion: apps/v1", to: "apiVersion: extensions/v1beta1",
    want: /extensions\/v1beta1 is not a group version Kubernetes 1\.33\.0 serves/ },
  { what: "duplicate key", file: NS, from: "type: Opaque\n", to: "type: Opaque\ntype: Opaque\n", want: /YAML: duplicated mapping key/ },
  { what: "image no Dockerfile builds", file: JOB, from: "image: poseidon/agent:latest", to: "image: poseidon/agnet:latest",
    want: /image poseidon\/agnet:latest is not built by docker\// },
  { what: "image tag no one builds", file: SERVERS, from: "image: poseidon/server:latest", to: "image: poseidon/server:v9",
    want: /image poseidon\/server:v9 is not built/ },
  { what: "command the image does not install", file: JOB, from: "          image: poseidon/agent:latest\n",
    to: "          image: poseidon/agent:latest\n          command: [poseidon-server]\n",
    want: /container agent: runs poseidon-server, which image poseidon\/agent:latest .* does not install/ },
  { what: "script neither in the image nor mounted", file: JOB, from: "command: [python3, /workspace/train.py]", to: "command: [python3, /opt/train.py]",
    want: /argument \/opt\/train\.py is neither in image/ },
  { what: "GPU outside the train Job", file: COORD, from: "limits: {memory: 1Gi}", to: "limits: {memory: 1Gi, nvidia.com/gpu: 1}",
    want: /coordinator: requests nvidia\.com\/gpu, but only the train Job/ },
  { what: "GPU on a CPU-only train image", file: JOB, from: "            limits: {memory: 8Gi}",
    to: "            limits: {memory: 8Gi, nvidia.com/gpu: 1}", want: /trainer: requests nvidia\.com\/gpu, but image poseidon\/train:latest .* has no CUDA/ },
  { what: "GPU requests without equal limits", file: JOB, from: "requests: {cpu: \"2\", memory: 4Gi}",
    to: "requests: {cpu: \"2\", memory: 4Gi, nvidia.com/gpu: 1}", want: /nvidia\.com\/gpu requests 1 must equal its limits \(none\)/ },
  { what: "selector that misses its template", file: SERVERS, from: "    matchLabels:\n      app.kubernetes.io/name: poseidon-server",
    to: "    matchLabels:\n      app.kubernetes.io/name: poseidon-servers", want: /selector app\.kubernetes\.io\/name=poseidon-servers does not match/ },
  { what: "probe on a port the container does not name", file: COORD, from: "tcpSocket: {port: grpc}", to: "tcpSocket: {port: grcp}",
    want: /readinessProbe names no port of the container: grcp/ },
];

// A GPU train job that is consistent: a train image with a CUDA PyTorch and an agent image with
// the CUDA stager plugin (both invented here, in the copy) -> no error.
const GPU_OK = [
  { file: JOB, from: "            limits: {memory: 8Gi}", to: "            limits: {memory: 8Gi, nvidia.com/gpu: 1}" },
  { file: "docker/Dockerfile.train", from: "python3-torch ", to: "python3-torch-cuda " },
  { file: "docker/Dockerfile.agent",
    from: "install -D -m 0755 build/agent/poseidon-agent /out/agent/usr/local/bin/poseidon-agent",
    to: "install -D -m 0755 build/agent/poseidon-agent /out/agent/usr/local/bin/poseidon-agent && install -D -m 0644 build/agent/libposeidon_cuda_stager.so /out/agent/usr/lib/poseidon/libposeidon_cuda_stager.so" },
];

function selfTest(root) {
  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), "k8s-validate-"));
  let failed = 0;
  const fresh = () => {
    const r = fs.mkdtempSync(path.join(tmp, "c-"));
    copyTree(path.join(root, "deploy", "kubernetes"), path.join(r, "deploy", "kubernetes"));
    copyTree(path.join(root, "docker"), path.join(r, "docker"));
    return r;
  };
  const base = new Set(check(root).errors);
  try {
    for (const c of CASES) {
      const r = fresh();
      edit(path.join(r, c.file), c.from, c.to);
      const got = check(r).errors.filter((e) => !base.has(e));
      if (got.some((e) => c.want.test(e))) {
        console.log(`self-test ok: ${c.what}: ${got.find((e) => c.want.test(e))}`);
      } else {
        failed++;
        console.log(`self-test FAIL: ${c.what}: wanted ${c.want}, got: ${got.length ? got.join(" | ") : "no new error"}`);
      }
    }
    const r = fresh();
    for (const e of GPU_OK) edit(path.join(r, e.file), e.from, e.to);
    const got = check(r).errors.filter((e) => !base.has(e));
    if (got.length === 0) console.log("self-test ok: a GPU trainer on a CUDA train image with a CUDA agent passes");
    else {
      failed++;
      console.log(`self-test FAIL: a consistent GPU job was refused: ${got.join(" | ")}`);
    }
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }
  return failed;
}

// ---------------------------------------------------------------- main

let status = 0;
if (args.selfTest) {
  const failed = selfTest(args.root);
  console.log(failed ? `self-test: ${failed} of ${CASES.length + 1} FAILED` : `self-test: ${CASES.length + 1} cases ok`);
  if (failed) status = 1;
}
const { docs, errors } = check(args.root);
for (const e of errors) console.log(`FAIL: ${e}`);
console.log(`kubernetes ${K8S_VERSION} (kubernetes-models ${PINNED["kubernetes-models"]}): ${docs.length} objects, ` +
            `${errors.length} problems: ${docs.map((d) => d.where).join(", ")}`);
if (errors.length) status = 1;
process.exit(status);
