//! Values between Rust and Python: a sample's fields besides the media ([`FieldValue`])
//! and its tensors, both ways (batches hand them to Python; a `map=` function's results come
//! back), and JSON-like data both ways (the library's serde types: settings, checkpoints).

use flowgate::dataset::FieldValue;
use flowgate::{DType, Tensor};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple,
};
use serde_json::Value;

/// A field's value as Python's: `str`, a parsed JSON value, `int`, `bytes`, or `None` for an
/// optional field a sample lacks.
pub(crate) fn field_to_py<'py>(
    py: Python<'py>,
    v: &flowgate::dataset::FieldValue,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        FieldValue::Text(t) => t.into_pyobject(py)?.into_any(),
        FieldValue::Json(j) => json_to_py(py, j)?,
        FieldValue::Int(i) => i.into_pyobject(py)?.into_any(),
        FieldValue::Bytes(b) => pyo3::types::PyBytes::new(py, b).into_any(),
        FieldValue::Missing => py.None().into_bound(py),
    })
}

pub(crate) fn json_to_py<'py>(
    py: Python<'py>,
    v: &serde_json::Value,
) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => pyo3::types::PyBool::new(py, *b).to_owned().into_any(),
        Value::Number(n) => match (n.as_i64(), n.as_u64()) {
            (Some(i), _) => i.into_pyobject(py)?.into_any(),
            (None, Some(u)) => u.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => PyList::new(
            py,
            a.iter()
                .map(|x| json_to_py(py, x))
                .collect::<PyResult<Vec<_>>>()?,
        )?
        .into_any(),
        Value::Object(o) => {
            let d = PyDict::new(py);
            for (k, x) in o {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

/// A Python value as a field's: `None` → missing, `int` → an integer (past `i64`, to `u64`'s
/// end: a JSON number), `str` → text, `bytes`
/// → bytes; `bool`, `float`, lists, tuples, dicts (`str` keys) and NumPy arrays and scalars
/// (through `tolist()`) → JSON.
pub(crate) fn field_from_py(v: &Bound<'_, PyAny>) -> PyResult<FieldValue> {
    if v.is_none() {
        return Ok(FieldValue::Missing);
    }
    if !v.is_instance_of::<PyBool>() && v.is_instance_of::<PyInt>() {
        if let Ok(i) = v.extract() {
            return Ok(FieldValue::Int(i));
        }
    }
    if let Ok(s) = v.downcast::<PyString>() {
        return Ok(FieldValue::Text(s.to_cow()?.into_owned()));
    }
    if let Ok(b) = v.downcast::<PyBytes>() {
        return Ok(FieldValue::Bytes(b.as_bytes().to_vec()));
    }
    if let Ok(b) = v.downcast::<PyByteArray>() {
        return Ok(FieldValue::Bytes(b.to_vec()));
    }
    Ok(FieldValue::Json(json_from_py(v, 0)?))
}

/// Nesting past this is refused (a value that contains itself, or a runaway structure).
const MAX_DEPTH: usize = 64;

fn json_from_py(v: &Bound<'_, PyAny>, depth: usize) -> PyResult<serde_json::Value> {
    use serde_json::Value;
    if depth > MAX_DEPTH {
        return Err(PyValueError::new_err(format!(
            "a field's value nests deeper than {MAX_DEPTH} levels"
        )));
    }
    if v.is_none() {
        return Ok(Value::Null);
    }
    if let Ok(b) = v.downcast::<PyBool>() {
        return Ok(Value::Bool(b.is_true()));
    }
    if v.is_instance_of::<PyInt>() {
        if let Ok(i) = v.extract::<i64>() {
            return Ok(i.into());
        }
        return match v.extract::<u64>() {
            Ok(u) => Ok(u.into()),
            // Its bits, not its digits: printing a huge int may itself raise.
            Err(_) => Err(PyValueError::new_err(format!(
                "a field's value holds an int of {} bits, past 64",
                v.call_method0("bit_length")?
            ))),
        };
    }
    if let Ok(f) = v.downcast::<PyFloat>() {
        let x = f.value();
        return serde_json::Number::from_f64(x)
            .map(Value::Number)
            .ok_or_else(|| {
                PyValueError::new_err(format!(
                    "a field's value holds {x}, which JSON has no number for"
                ))
            });
    }
    if let Ok(s) = v.downcast::<PyString>() {
        return Ok(Value::String(s.to_cow()?.into_owned()));
    }
    if let Ok(d) = v.downcast::<PyDict>() {
        let mut o = serde_json::Map::new();
        for (k, x) in d.iter() {
            let k = k.downcast::<PyString>().map_err(|_| {
                PyValueError::new_err(format!("a field's dict has a key that is not a str: {k}"))
            })?;
            o.insert(k.to_cow()?.into_owned(), json_from_py(&x, depth + 1)?);
        }
        return Ok(Value::Object(o));
    }
    if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
        return v
            .try_iter()?
            .map(|x| json_from_py(&x?, depth + 1))
            .collect::<PyResult<Vec<_>>>()
            .map(Value::Array);
    }
    if v.hasattr("tolist")? {
        // NumPy arrays and scalars, torch tensors.
        return json_from_py(&v.call_method0("tolist")?, depth + 1);
    }
    Err(PyValueError::new_err(format!(
        "a field's value must be None, an int, a str, bytes, a bool, a float, a list, a dict \
         or an array, not {}",
        v.get_type().name()?
    )))
}

/// An array-like (a NumPy array, a torch tensor on the CPU, a `flowgate.Batch`, nested
/// lists) as a tensor: copied, in its dtype (`uint8`, `float32` or `int64`).
pub(crate) fn tensor_from_py(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Tensor> {
    let py = v.py();
    // `asarray(order="C")`, not `ascontiguousarray`, which makes a 0-d array 1-d.
    let kw = PyDict::new(py);
    kw.set_item("order", "C")?;
    let mut a = py
        .import("numpy")?
        .call_method("asarray", (v,), Some(&kw))?;
    // Another byte order (`>f4`) is converted, not read as this machine's (wrong numbers).
    if !a.getattr("dtype")?.getattr("isnative")?.extract::<bool>()? {
        let native = a.getattr("dtype")?.call_method1("newbyteorder", ("=",))?;
        a = a.call_method1("astype", (native,))?;
    }
    let dtype: String = a.getattr("dtype")?.getattr("name")?.extract()?;
    let d = DType::from_numpy(&dtype).ok_or_else(|| {
        PyValueError::new_err(format!(
            "{name:?} must be an array of uint8, float32 or int64, not {dtype}"
        ))
    })?;
    let shape: Vec<usize> = a.getattr("shape")?.extract()?;
    let bytes = a.call_method0("tobytes")?;
    let bytes = bytes.downcast::<PyBytes>()?.as_bytes();
    let mut t = Tensor::zeros(&shape, d);
    t.bytes_mut().copy_from_slice(bytes);
    Ok(t)
}

/// A Python value as JSON-like data for the library's settings types: `None`, bools (NumPy's
/// too), strings (`str` subclasses as their value), integers (anything with `__index__`; past
/// 64 bits out of every range), numbers (anything with `__float__`: NumPy's, `Decimal`,
/// `Fraction`; NaN and the infinities as their names, which every number refuses), NumPy's
/// values as `tolist()` gives them, mappings, and other iterables as lists; anything else is
/// refused, naming the key it was given for.
pub(crate) fn value_of(v: &Bound<'_, PyAny>) -> Result<Value, String> {
    let type_name = v.get_type().name().map_or("?".into(), |n| n.to_string());
    let text = |e: PyErr| e.to_string();
    Ok(if v.is_none() {
        Value::Null
    } else if v.is_instance_of::<PyBool>() || type_name.starts_with("bool") {
        Value::Bool(v.is_truthy().map_err(text)?)
    } else if let Ok(s) = v.downcast::<PyString>() {
        Value::String(s.to_cow().map_err(text)?.into_owned())
    } else if v.hasattr("tolist").map_err(text)? {
        // NumPy's arrays and scalars, `array.array`, `memoryview`: as Python's own values.
        value_of(&v.call_method0("tolist").map_err(text)?)?
    } else if v.hasattr("__index__").map_err(text)? {
        match (v.extract::<i64>(), v.extract::<u64>()) {
            (Ok(n), _) => Value::from(n),
            (_, Ok(n)) => Value::from(n),
            _ => return Err(format!("{v} is out of range")),
        }
    } else if v.hasattr("__float__").map_err(text)? {
        let f: f64 = v.extract().map_err(text)?;
        serde_json::Number::from_f64(f).map_or(Value::String(f.to_string()), Value::Number)
    } else if let Ok(d) = v.downcast::<PyDict>() {
        let mut m = serde_json::Map::new();
        for (k, x) in d.iter() {
            let k = k.to_string();
            let x = value_of(&x).map_err(|e| format!("{k}: {e}"))?;
            m.insert(k, x);
        }
        Value::Object(m)
    } else if let (false, Ok(items)) = (v.is_instance_of::<PyBytes>(), v.try_iter()) {
        Value::Array(
            items
                .map(|x| value_of(&x.map_err(text)?))
                .collect::<Result<_, _>>()?,
        )
    } else {
        return Err(format!("not a {type_name}"));
    })
}
