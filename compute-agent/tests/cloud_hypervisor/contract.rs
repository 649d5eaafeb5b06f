//! The contract: Cloud Hypervisor's OpenAPI document and the two checkers (the
//! JSON-schema validator and the strict checker of our own), and how Cloud Hypervisor's
//! option parser splits a `--disk` option.

use super::*;

pub(crate) const DOC_IN_SHARED: &str = "shared/third_party/cloud-hypervisor/cloud-hypervisor.yaml";

pub(crate) fn doc_path() -> PathBuf {
    if let Some(p) = std::env::var_os("DEVLEND_CH_OPENAPI") {
        return PathBuf::from(p);
    }
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    // The copy kept in the repository (third_party/cloud-hypervisor/), else a shared/
    // tree above it.
    if let Some(repo) = here.parent() {
        let copy = repo.join("third_party/cloud-hypervisor/cloud-hypervisor.yaml");
        if copy.is_file() {
            return copy;
        }
    }
    here.ancestors()
        .map(|dir| dir.join(DOC_IN_SHARED))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "Cloud Hypervisor's OpenAPI document not found: no {DOC_IN_SHARED} above {} \
                 (set DEVLEND_CH_OPENAPI to its path)",
                here.display()
            )
        })
}

/// Cloud Hypervisor's OpenAPI document, as JSON.
pub(crate) struct Contract {
    pub(crate) doc: Value,
}

pub(crate) fn contract() -> &'static Contract {
    static C: OnceLock<Contract> = OnceLock::new();
    C.get_or_init(|| {
        let path = doc_path();
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let yaml: serde_norway::Value = serde_norway::from_str(&text)
            .unwrap_or_else(|e| panic!("{} is not YAML: {e}", path.display()));
        Contract {
            doc: yaml_to_json(yaml),
        }
    })
}

/// YAML to JSON; map keys become strings (the document keys responses by number).
pub(crate) fn yaml_to_json(y: serde_norway::Value) -> Value {
    use serde_norway::Value as Y;
    match y {
        Y::Null => Value::Null,
        Y::Bool(b) => Value::Bool(b),
        Y::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                n.as_f64().map_or(Value::Null, Value::from)
            }
        }
        Y::String(s) => Value::String(s),
        Y::Sequence(v) => Value::Array(v.into_iter().map(yaml_to_json).collect()),
        Y::Mapping(m) => Value::Object(
            m.into_iter()
                .map(|(k, v)| {
                    let key = match k {
                        Y::String(s) => s,
                        Y::Number(n) => n.to_string(),
                        Y::Bool(b) => b.to_string(),
                        other => panic!("unexpected YAML map key {other:?}"),
                    };
                    (key, yaml_to_json(v))
                })
                .collect(),
        ),
        Y::Tagged(t) => yaml_to_json(t.value),
    }
}

impl Contract {
    /// `components/schemas/NAME`.
    pub(crate) fn schema(&self, name: &str) -> &Value {
        let s = &self.doc["components"]["schemas"][name];
        assert!(
            s.is_object(),
            "no components/schemas/{name} in the document"
        );
        s
    }

    /// Follows `$ref`s (`#/...` pointers into the document).
    pub(crate) fn resolve<'a>(&'a self, mut s: &'a Value) -> &'a Value {
        for _ in 0..32 {
            let Some(r) = s.get("$ref").and_then(Value::as_str) else {
                return s;
            };
            let pointer = r
                .strip_prefix('#')
                .unwrap_or_else(|| panic!("$ref {r:?} is not local to the document"));
            s = self
                .doc
                .pointer(pointer)
                .unwrap_or_else(|| panic!("$ref {r:?} points nowhere"));
        }
        panic!("$ref chain too long");
    }

    /// Everything wrong with `value` as a `components/schemas/NAME`, by both checkers.
    pub(crate) fn check(&self, name: &str, value: &Value) -> Vec<String> {
        let mut errs = self.jsonschema_errors(name, value);
        errs.extend(self.strict_errors(name, value));
        errs
    }

    /// The JSON-schema validator's verdict: `components/schemas/NAME`, the document's
    /// schemas carried along (converted from OpenAPI 3.0) so that `$ref`s resolve.
    pub(crate) fn jsonschema_errors(&self, name: &str, value: &Value) -> Vec<String> {
        let schemas: serde_json::Map<String, Value> = self.doc["components"]["schemas"]
            .as_object()
            .expect("components/schemas")
            .iter()
            .map(|(k, v)| (k.clone(), openapi_schema_to_json_schema(v)))
            .collect();
        let root = json!({
            "$ref": format!("#/components/schemas/{name}"),
            "components": { "schemas": schemas },
        });
        let validator = jsonschema::options()
            .with_draft(jsonschema::Draft::Draft4)
            .build(&root)
            .unwrap_or_else(|e| panic!("schema {name} does not compile: {e}"));
        validator
            .iter_errors(value)
            .map(|e| format!("jsonschema: {e} (at {})", e.instance_path()))
            .collect()
    }

    /// The strict checker's verdict (see [`Contract::strict`]).
    pub(crate) fn strict_errors(&self, name: &str, value: &Value) -> Vec<String> {
        let mut errs = Vec::new();
        self.strict(self.schema(name), value, name, &mut errs);
        errs
    }

    /// Strict check of `v` against `schema`: every key must be a declared property
    /// (recursively), every `required` key present, types, integer formats and enums
    /// respected. Constructs it does not know are errors, so that it never passes
    /// something it did not look at.
    pub(crate) fn strict(&self, schema: &Value, v: &Value, at: &str, errs: &mut Vec<String>) {
        let s = self.resolve(schema);
        for k in ["allOf", "anyOf", "oneOf", "not"] {
            if s.get(k).is_some() {
                errs.push(format!(
                    "strict: {at}: schema uses {k}, which this checker does not handle"
                ));
                return;
            }
        }
        if v.is_null() {
            if s.get("nullable") != Some(&Value::Bool(true)) {
                errs.push(format!(
                    "strict: {at}: null where the schema is not nullable"
                ));
            }
            return;
        }
        if let Some(allowed) = s.get("enum").and_then(Value::as_array) {
            if !allowed.contains(v) {
                errs.push(format!("strict: {at}: {v} is not one of {allowed:?}"));
            }
        }
        let ty = match s.get("type").and_then(Value::as_str) {
            Some(t) => t,
            None if s.get("properties").is_some() => "object",
            None => {
                errs.push(format!("strict: {at}: schema has no type"));
                return;
            }
        };
        match ty {
            "object" => {
                let Some(obj) = v.as_object() else {
                    errs.push(format!("strict: {at}: {v} is not an object"));
                    return;
                };
                let props = s.get("properties").and_then(Value::as_object);
                for (k, x) in obj {
                    let here = format!("{at}.{k}");
                    match props.and_then(|p| p.get(k)) {
                        Some(ps) => self.strict(ps, x, &here, errs),
                        None => match s.get("additionalProperties") {
                            Some(ap) if ap.is_object() => self.strict(ap, x, &here, errs),
                            _ => {
                                errs.push(format!("strict: {here}: no such property in the schema"))
                            }
                        },
                    }
                }
                for r in s
                    .get("required")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let r = r.as_str().unwrap_or_default();
                    if !obj.contains_key(r) {
                        errs.push(format!("strict: {at}: required property {r:?} missing"));
                    }
                }
            }
            "array" => {
                let Some(items) = v.as_array() else {
                    errs.push(format!("strict: {at}: {v} is not an array"));
                    return;
                };
                let Some(item_schema) = s.get("items") else {
                    errs.push(format!("strict: {at}: array schema without items"));
                    return;
                };
                for (i, x) in items.iter().enumerate() {
                    self.strict(item_schema, x, &format!("{at}[{i}]"), errs);
                }
            }
            "string" if !v.is_string() => errs.push(format!("strict: {at}: {v} is not a string")),
            "boolean" if !v.is_boolean() => {
                errs.push(format!("strict: {at}: {v} is not a boolean"))
            }
            "number" if !v.is_number() => errs.push(format!("strict: {at}: {v} is not a number")),
            "integer" => {
                let n = v.as_i64().map(i128::from).or(v.as_u64().map(i128::from));
                let Some(n) = n else {
                    errs.push(format!("strict: {at}: {v} is not an integer"));
                    return;
                };
                let format = s.get("format").and_then(Value::as_str);
                let range: Option<(i128, i128)> = match format {
                    Some("int8") => Some((i8::MIN.into(), i8::MAX.into())),
                    Some("int16") => Some((i16::MIN.into(), i16::MAX.into())),
                    Some("int32") => Some((i32::MIN.into(), i32::MAX.into())),
                    Some("int64") => Some((i64::MIN.into(), i64::MAX.into())),
                    Some("uint8") => Some((0, u8::MAX.into())),
                    Some("uint16") => Some((0, u16::MAX.into())),
                    Some("uint32") => Some((0, u32::MAX.into())),
                    Some("uint64") => Some((0, u64::MAX.into())),
                    None => None,
                    Some(f) => {
                        errs.push(format!("strict: {at}: unknown integer format {f:?}"));
                        None
                    }
                };
                if let Some((lo, hi)) = range {
                    if !(lo..=hi).contains(&n) {
                        errs.push(format!("strict: {at}: {n} is out of {format:?} range"));
                    }
                }
            }
            "string" | "boolean" | "number" => {}
            other => errs.push(format!("strict: {at}: unknown type {other:?}")),
        }
    }
}

/// An OpenAPI 3.0 schema object as a JSON Schema (draft 4): `nullable: true` becomes a
/// `null` alternative in `type`; OpenAPI-only annotations are dropped; integer formats
/// (`int16`, `uint8`, ...) are left as annotations (the strict checker checks them).
pub(crate) fn openapi_schema_to_json_schema(s: &Value) -> Value {
    let Some(obj) = s.as_object() else {
        return s.clone();
    };
    let mut out = serde_json::Map::new();
    for (k, v) in obj {
        let v = match k.as_str() {
            "nullable" | "example" | "discriminator" | "readOnly" | "writeOnly" | "xml"
            | "externalDocs" | "deprecated" => continue,
            "properties" => Value::Object(
                v.as_object()
                    .into_iter()
                    .flatten()
                    .map(|(p, ps)| (p.clone(), openapi_schema_to_json_schema(ps)))
                    .collect(),
            ),
            "items" | "additionalProperties" | "not" => openapi_schema_to_json_schema(v),
            "allOf" | "anyOf" | "oneOf" => Value::Array(
                v.as_array()
                    .into_iter()
                    .flatten()
                    .map(openapi_schema_to_json_schema)
                    .collect(),
            ),
            _ => v.clone(),
        };
        out.insert(k.clone(), v);
    }
    if obj.get("nullable") == Some(&Value::Bool(true)) {
        if let Some(t) = obj.get("type").and_then(Value::as_str) {
            out.insert("type".into(), json!([t, "null"]));
        }
    }
    Value::Object(out)
}

/// The `$ref` of an operation's JSON request body.
pub(crate) fn request_schema_ref(op: &Value) -> &str {
    op["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        .as_str()
        .unwrap_or_default()
}

/// Splits a Cloud Hypervisor `key=value,...` option the way its option parser does:
/// commas inside double quotes do not split, and the quotes are dropped.
pub(crate) fn parse_ch_option(s: &str) -> Vec<(String, String)> {
    let mut parts = vec![String::new()];
    let mut quoted = false;
    for ch in s.trim().chars() {
        match ch {
            '"' => quoted = !quoted,
            ',' if !quoted => parts.push(String::new()),
            c => parts.last_mut().expect("a part").push(c),
        }
    }
    assert!(!quoted, "unbalanced quotes in {s:?}");
    parts
        .into_iter()
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or_else(|| panic!("no = in {p:?}"));
            (k.to_owned(), v.trim().to_owned())
        })
        .collect()
}
