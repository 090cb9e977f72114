// Validates Prometheus Operator manifests (monitoring.coreos.com/v1 PodMonitor, PrometheusRule) against the
// operator's CRD schemas, as compiled into validators by the npm package pinned in package.json (README.md).
//
//   node validate.mjs <dir with node_modules> < manifests.json  ->  {"version": "...", "errors": [[...], ...]}
//
// One list of "path: message" per manifest, empty when it is valid. The compiled validators check types,
// patterns, enums and required fields, but let unknown fields through (the CRDs set no additionalProperties),
// while the API server drops or, with kubectl's strict field validation, refuses them. So each field is also
// probed: replaced in turn by `true` and by a string, one of which every field a structural schema names
// rejects (each such field has a type); a field that takes both is one the schema does not name.
import { createRequire } from "node:module";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const root = join(process.argv[2], "node_modules");
const require = createRequire(join(root, "_"));
const localize = require("ajv-i18n/localize/en");
const models = join(root, "@kubernetes-models", "prometheus-operator");
const { version } = require("@kubernetes-models/prometheus-operator/package.json");

const load = async (kind) =>
  (await import(pathToFileURL(join(models, "_schemas", `MonitoringCoreosComV1${kind}.js`)).href)).validate;
const validators = {
  "monitoring.coreos.com/v1 PodMonitor": await load("PodMonitor"),
  "monitoring.coreos.com/v1 PrometheusRule": await load("PrometheusRule"),
};

const pointer = (key) => String(key).replaceAll("~", "~0").replaceAll("/", "~1");
const readable = (path) => path.slice(1).split("/").map((p) => p.replaceAll("~1", "/").replaceAll("~0", "~")).join("/");

function schemaErrors(validate, doc) {
  if (validate(doc)) return [];
  localize(validate.errors);
  return validate.errors.map((e) => `${readable(e.instancePath)}: ${e.message}`);
}

function unknownFields(validate, doc) {
  const found = [];
  const rejects = (path) => (validate(doc) ? false : validate.errors.some((e) => e.instancePath === path));
  const walk = (node, path) => {
    if (Array.isArray(node)) {
      node.forEach((item, i) => walk(item, `${path}/${i}`));
    } else if (node !== null && typeof node === "object") {
      for (const key of Object.keys(node)) {
        const here = `${path}/${pointer(key)}`;
        const value = node[key];
        const named = [true, "\u0000"].some((probe) => {
          node[key] = probe;
          return rejects(here);
        });
        node[key] = value;
        if (named) walk(value, here);
        else found.push(`${readable(path)}: '${key}' was unexpected`);
      }
    }
  };
  walk(doc, "");
  return found;
}

const input = await new Promise((resolve) => {
  let text = "";
  process.stdin.on("data", (chunk) => (text += chunk)).on("end", () => resolve(text));
});
const errors = JSON.parse(input).map((doc) => {
  const validate = validators[`${doc.apiVersion} ${doc.kind}`];
  if (!validate) return [`: no schema for ${doc.apiVersion} ${doc.kind}`];
  return [...schemaErrors(validate, structuredClone(doc)), ...unknownFields(validate, structuredClone(doc))];
});
process.stdout.write(JSON.stringify({ version, errors }));
