//! SLURM's compact host lists: `gpu[01-04,07],cpu3` -> gpu01 gpu02 gpu03 gpu04 gpu07 cpu3.
//! Several bracket groups in one name expand as a product (`r[1-2]n[1-2]`); zero padding is
//! kept from the width of the range's first bound.

/// Expands a compact host list; the error says which part is malformed.
pub fn expand(list: &str) -> Result<Vec<String>, String> {
    let mut hosts = Vec::new();
    for item in split_top_level(list)? {
        if item.is_empty() {
            continue;
        }
        hosts.extend(expand_item(&item)?);
    }
    Ok(hosts)
}

/// Splits on commas that are outside brackets.
fn split_top_level(list: &str) -> Result<Vec<String>, String> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut current = String::new();
    for c in list.trim().chars() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(format!("unbalanced brackets in host list '{list}'"));
        }
        if c == ',' && depth == 0 {
            items.push(std::mem::take(&mut current));
        } else {
            current.push(c);
        }
    }
    if depth != 0 {
        return Err(format!("unclosed '[' in host list '{list}'"));
    }
    items.push(current);
    Ok(items)
}

fn expand_item(item: &str) -> Result<Vec<String>, String> {
    let Some(open) = item.find('[') else {
        return Ok(vec![item.to_string()]);
    };
    let close = item[open..]
        .find(']')
        .map(|i| i + open)
        .ok_or_else(|| format!("unclosed '[' in host '{item}'"))?;
    let prefix = &item[..open];
    let ranges = &item[open + 1..close];
    let rest = expand_item(&item[close + 1..])?;
    let mut out = Vec::new();
    for part in ranges.split(',') {
        let part = part.trim();
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a, b),
            None => (part, part),
        };
        let width = lo.len();
        let parse = |s: &str| {
            s.parse::<u64>().map_err(|_| {
                format!("'{part}' in host '{item}' is not a number or range like 01-04")
            })
        };
        let (a, b) = (parse(lo)?, parse(hi)?);
        if a > b {
            return Err(format!("range '{part}' in host '{item}' runs backwards"));
        }
        for n in a..=b {
            for suffix in &rest {
                out.push(format!("{prefix}{n:0width$}{suffix}"));
            }
        }
    }
    Ok(out)
}
