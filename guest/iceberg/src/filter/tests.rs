//! Tests of the `overwrite_filter` module: grammar, binding, the partition
//! check, projection and classification, and the Arrow row check.

use std::sync::Arc;

use arrow_array::{
    ArrayRef, Date32Array, Decimal128Array, Float64Array, LargeStringArray, RecordBatch, StringArray,
    TimestampMicrosecondArray,
};
use arrow_schema::{DataType, Field, Schema as ArrowSchema};
use iceberg::expr::BoundPredicate;
use iceberg::spec::{
    Datum, Literal, NestedField, PartitionSpec, PrimitiveType, Schema, SchemaRef, Struct, Transform, Type,
};
use iceberg::transform::create_transform_function;

use super::parse::{CmpOp, Expr, LitValue};
use super::{FilterError, OverwriteFilter, Placement};

const TABLE: &str = "db.events";

fn schema() -> SchemaRef {
    let p = |ty| Type::Primitive(ty);
    let fields = vec![
        NestedField::optional(1, "day", p(PrimitiveType::Date)),
        NestedField::optional(2, "ts", p(PrimitiveType::Timestamp)),
        NestedField::optional(3, "region", p(PrimitiveType::String)),
        NestedField::optional(4, "amount", p(PrimitiveType::Decimal { precision: 9, scale: 2 })),
        NestedField::optional(5, "qty", p(PrimitiveType::Int)),
        NestedField::optional(6, "n", p(PrimitiveType::Long)),
        NestedField::optional(7, "score", p(PrimitiveType::Double)),
        NestedField::optional(8, "flag", p(PrimitiveType::Boolean)),
        NestedField::optional(9, "tstz", p(PrimitiveType::Timestamptz)),
        NestedField::optional(10, "Kind", p(PrimitiveType::String)),
        NestedField::optional(11, "order date", p(PrimitiveType::String)),
        NestedField::required(12, "id", p(PrimitiveType::Long)),
    ];
    Arc::new(Schema::builder().with_fields(fields.into_iter().map(Arc::new)).build().unwrap())
}

fn spec(fields: &[(&str, &str, Transform)]) -> PartitionSpec {
    let mut b = PartitionSpec::builder(schema()).with_spec_id(1);
    for (source, name, transform) in fields {
        b = b.add_partition_field(*source, *name, *transform).unwrap();
    }
    b.build().unwrap()
}

/// The parse tree as an s-expression, positions left out.
fn sexp(e: &Expr) -> String {
    fn lit(v: &LitValue) -> String {
        match v {
            LitValue::Str(s) => format!("{s:?}"),
            LitValue::Int(s) => format!("int:{s}"),
            LitValue::Dec(s) => format!("dec:{s}"),
            LitValue::Bool(b) => format!("bool:{b}"),
        }
    }
    let op = |op: &CmpOp| match op {
        CmpOp::Lt => "<",
        CmpOp::LtEq => "<=",
        CmpOp::Gt => ">",
        CmpOp::GtEq => ">=",
        CmpOp::Eq => "=",
        CmpOp::NotEq => "!=",
    };
    match e {
        Expr::Always(b) => format!("{b}"),
        Expr::And(l, r) => format!("(and {} {})", sexp(l), sexp(r)),
        Expr::Or(l, r) => format!("(or {} {})", sexp(l), sexp(r)),
        Expr::Not(e) => format!("(not {})", sexp(e)),
        Expr::Compare { column, op: o, literal } => format!("({} {} {})", op(o), column.name, lit(&literal.value)),
        Expr::In { column, negated, literals } => format!(
            "({} {} {})",
            if *negated { "not-in" } else { "in" },
            column.name,
            literals.iter().map(|l| lit(&l.value)).collect::<Vec<_>>().join(" ")
        ),
        Expr::Null { column, negated } => format!("({} {})", if *negated { "not-null" } else { "null" }, column.name),
        Expr::Nan { column, negated } => format!("({} {})", if *negated { "not-nan" } else { "nan" }, column.name),
        Expr::StartsWith { column, negated, prefix, .. } => {
            format!("({} {} {prefix:?})", if *negated { "not-starts" } else { "starts" }, column.name)
        }
    }
}

fn parsed(text: &str) -> String {
    match OverwriteFilter::parse(text) {
        Ok(f) => sexp(&f.expr),
        Err(e) => panic!("{text:?} did not parse: {e}"),
    }
}

fn parse_error(text: &str) -> String {
    match OverwriteFilter::parse(text) {
        Ok(f) => panic!("{text:?} parsed as {}", sexp(&f.expr)),
        Err(e) => e.to_string(),
    }
}

#[test]
fn not_binds_tighter_than_and_which_binds_tighter_than_or() {
    assert_eq!(parsed("a = 1 or b = 2 and not c = 3"), "(or (= a int:1) (and (= b int:2) (not (= c int:3))))");
    assert_eq!(parsed("not a = 1 and b = 2"), "(and (not (= a int:1)) (= b int:2))");
    assert_eq!(parsed("a = 1 and b = 2 or c = 3"), "(or (and (= a int:1) (= b int:2)) (= c int:3))");
    // chains are balanced trees (the operators are associative)
    assert_eq!(parsed("a = 1 and b = 2 and c = 3"), "(and (and (= a int:1) (= b int:2)) (= c int:3))");
    assert_eq!(parsed("a = 1 or b = 2 or c = 3"), "(or (or (= a int:1) (= b int:2)) (= c int:3))");
    assert_eq!(
        parsed("a = 1 or b = 2 or c = 3 or d = 4 or e = 5"),
        "(or (or (or (= a int:1) (= b int:2)) (= c int:3)) (or (= d int:4) (= e int:5)))"
    );
    // parentheses override, and nest
    assert_eq!(parsed("(a = 1 or b = 2) and c = 3"), "(and (or (= a int:1) (= b int:2)) (= c int:3))");
    assert_eq!(parsed("not (a = 1 or ((b = 2)))"), "(not (or (= a int:1) (= b int:2)))");
    assert_eq!(parsed("not not a = 1"), "(not (not (= a int:1)))");
}

#[test]
fn keywords_are_case_insensitive_and_columns_keep_their_case() {
    assert_eq!(
        parsed("Day = 1 AnD NOT Region Is NuLl OR x iN (1, 2) oR y NOT LIKE 'a%' and z IS NOT NAN"),
        "(or (or (and (= Day int:1) (not (null Region))) (in x int:1 int:2)) (and (not-starts y \"a\") (not-nan z)))"
    );
    assert_eq!(parsed("flag = TRUE and other = False"), "(and (= flag bool:true) (= other bool:false))");
}

#[test]
fn strings_quote_with_doubled_quotes_and_columns_with_double_quotes() {
    assert_eq!(parsed("region = 'it''s'"), "(= region \"it's\")");
    assert_eq!(parsed("region = ''''"), "(= region \"'\")");
    assert_eq!(parsed("region = ''"), "(= region \"\")");
    assert_eq!(parsed("region = 'a and b or (c)'"), "(= region \"a and b or (c)\")");
    assert_eq!(parsed("\"order date\" = 'x'"), "(= order date \"x\")");
    // a keyword as a column name, quoted
    assert_eq!(parsed("\"and\" = 1 and \"not\" is null"), "(and (= and int:1) (null not))");
    assert_eq!(parsed("col_$1 = 'é'"), "(= col_$1 \"é\")");
}

#[test]
fn numbers_and_booleans() {
    assert_eq!(
        parsed("a = 5 or b = -5 or c = +5 or d = 1.50 or e = .5 or f = 5. or g = -0.25"),
        "(or (or (or (= a int:5) (= b int:-5)) (or (= c int:+5) (= d dec:1.50))) \
         (or (or (= e dec:.5) (= f dec:5.)) (= g dec:-0.25)))"
    );
    assert_eq!(parsed("true"), "true");
    assert_eq!(parsed("FALSE or a = 1"), "(or false (= a int:1))");
    // a boolean literal on the left is a comparison, not a constant
    assert_eq!(parsed("true = flag"), "(= flag bool:true)");
}

#[test]
fn a_literal_on_the_left_flips_the_operator() {
    assert_eq!(parsed("'2024-01-01' <= day"), "(>= day \"2024-01-01\")");
    assert_eq!(parsed("5 < x"), "(> x int:5)");
    assert_eq!(parsed("5 > x"), "(< x int:5)");
    assert_eq!(parsed("5 >= x"), "(<= x int:5)");
    assert_eq!(parsed("5 <= x"), "(>= x int:5)");
    assert_eq!(parsed("5 = x"), "(= x int:5)");
    assert_eq!(parsed("5 == x"), "(= x int:5)");
    assert_eq!(parsed("5 != x"), "(!= x int:5)");
    assert_eq!(parsed("5 <> x"), "(!= x int:5)");
    // and stays put on the right
    assert_eq!(parsed("x<5"), "(< x int:5)");
    assert_eq!(
        parsed("x<=5 and x>=1 and x<>3 and x==2"),
        "(and (and (<= x int:5) (>= x int:1)) (and (!= x int:3) (= x int:2)))"
    );
}

#[test]
fn in_and_not_in_take_literal_lists() {
    assert_eq!(parsed("region in ('eu', 'us')"), "(in region \"eu\" \"us\")");
    assert_eq!(parsed("n not in (1, 2.5, -3)"), "(not-in n int:1 dec:2.5 int:-3)");
    assert_eq!(parsed("n in (7)"), "(in n int:7)");
    assert_eq!(parsed("not n in (7)"), "(not (in n int:7))");
}

#[test]
fn null_and_nan_checks() {
    assert_eq!(parsed("x is null"), "(null x)");
    assert_eq!(parsed("x is not null"), "(not-null x)");
    assert_eq!(parsed("x is nan"), "(nan x)");
    assert_eq!(parsed("x IS NOT NaN"), "(not-nan x)");
}

#[test]
fn like_is_starts_with_only() {
    assert_eq!(parsed("region like 'eu-%'"), "(starts region \"eu-\")");
    assert_eq!(parsed("region not like 'eu-%'"), "(not-starts region \"eu-\")");
    assert_eq!(parsed("region like '50\\%%'"), "(starts region \"50%\")");
    // no wildcard: an equality, as PyIceberg reads it; `_` is no wildcard
    assert_eq!(parsed("region like 'a_b'"), "(= region \"a_b\")");
    assert_eq!(parsed("region not like 'a\\%'"), "(!= region \"a%\")");
    assert_eq!(
        parse_error("region like 'e%u%'"),
        "overwrite_filter: at character 13: like 'e%u%' has a '%' before its end; only a pattern ending in \
         one '%' (starts-with) is supported, write \\% for a literal '%'"
    );
    assert_eq!(parse_error("region like '%eu'").split(": like").next(), Some("overwrite_filter: at character 13"));
    assert_eq!(
        parse_error("region like 5"),
        "overwrite_filter: at character 13: expected a quoted pattern after 'like', found the number 5"
    );
}

#[test]
fn syntax_errors_name_the_position_what_was_expected_and_what_was_found() {
    let cases = [
        ("(day = 'x' or n = )", "at character 19: expected a literal after '=', found ')'"),
        ("day >= '2024-01-01' and day <", "at character 30: expected a literal after '<', found the end of the filter"),
        (
            "region = 'eu",
            "at character 13: expected ' to close the string that starts at character 10, found the end of the filter",
        ),
        (
            "(a = 1 and b = 2",
            "at character 17: expected ')' to close the '(' at character 1, found the end of the filter",
        ),
        (
            "(a = 1 b = 2)",
            "at character 8: expected 'and', 'or' or ')' to close the '(' at character 1, found column b",
        ),
        ("a = 1 b = 2", "at character 7: expected 'and', 'or' or the end of the filter, found column b"),
        ("a in ()", "at character 7: expected a literal in the list after 'in', found ')'"),
        ("a in (1, )", "at character 10: expected a literal after ',', found ')'"),
        ("a in (1 2)", "at character 9: expected ',' or ')' in the list, found the number 2"),
        ("a not in 1", "at character 10: expected '(' after 'not in', found the number 1"),
        ("a is 5", "at character 6: expected 'null' or 'nan' after 'is', found the number 5"),
        ("a is not true", "at character 10: expected 'null' or 'nan' after 'is not', found 'true'"),
        ("a not = 1", "at character 7: expected 'in' or 'like' after 'not', found '='"),
        (
            "a # 1",
            "at character 3: expected an operator after column a (< <= > >= = == != <>, in, not in, is, like), found '#'",
        ),
        (
            "a",
            "at character 2: expected an operator after column a (< <= > >= = == != <>, in, not in, is, like), found the end of the filter",
        ),
        ("'a' = 'b'", "at character 7: expected a column after '=', found the string 'b'"),
        ("a = b", "at character 5: expected a literal after '=', found column b"),
        ("5 and a = 1", "at character 3: expected a comparison operator (< <= > >= = == != <>) after 5, found 'and'"),
        ("a = 12ab", "at character 5: expected a number, found '12ab'"),
        ("a = 1.2.3", "at character 5: expected a number, found '1.2.3'"),
        ("a = -", "at character 5: expected a literal after '=', found '-'"),
        ("a = 1 or ?", "at character 10: expected a column, a literal, 'not' or '(', found '?'"),
        ("a ! 1", "at character 3: expected '!=', found '!'"),
        (
            "\"day = 1",
            "at character 9: expected \" to close the column name that starts at character 1, found the end of the filter",
        ),
        ("and a = 1", "at character 1: expected a column, a literal, 'not' or '(', found 'and'"),
        ("a = 1 and", "at character 10: expected a column, a literal, 'not' or '(', found the end of the filter"),
        ("  ", "at character 1: expected a predicate such as day = '2024-01-31', found an empty filter"),
        (
            "table.day = 1",
            "at character 6: expected an operator after column table (< <= > >= = == != <>, in, not in, is, like), found '.'",
        ),
    ];
    for (text, message) in cases {
        assert_eq!(parse_error(text), format!("overwrite_filter: {message}"), "for {text:?}");
    }
}

#[test]
fn error_positions_count_characters_and_keep_the_byte_offset() {
    let err = OverwriteFilter::parse("region = 'é' or").unwrap_err();
    match err {
        FilterError::Syntax { offset, character, .. } => {
            assert_eq!(offset, 16, "bytes: é is two");
            assert_eq!(character, 16, "characters, 1-based");
        }
        other => panic!("{other:?}"),
    }
    // a non-ASCII character where a token starts
    assert_eq!(
        parse_error("région = 1"),
        "overwrite_filter: at character 2: expected an operator after column r (< <= > >= = == != <>, in, not in, is, like), found 'é'"
    );
}

#[test]
fn columns_are_listed_once_in_order() {
    let f =
        OverwriteFilter::parse("day >= '2024-01-01' and (region = 'eu' or day < '2024-02-01') and 5 < qty").unwrap();
    assert_eq!(f.columns(), vec!["day", "region", "qty"]);
    assert_eq!(f.source(), "day >= '2024-01-01' and (region = 'eu' or day < '2024-02-01') and 5 < qty");
}

fn bind(text: &str) -> Result<super::BoundFilter, FilterError> {
    OverwriteFilter::parse(text).unwrap().bind(&schema(), TABLE)
}

fn bound(text: &str) -> String {
    match bind(text) {
        Ok(b) => b.predicate().to_string(),
        Err(e) => panic!("{text:?} did not bind: {e}"),
    }
}

fn bind_error(text: &str) -> String {
    match bind(text) {
        Ok(b) => panic!("{text:?} bound as {}", b.predicate()),
        Err(e) => e.to_string(),
    }
}

/// The literal of a bound `column op literal`.
fn bound_literal(text: &str) -> Datum {
    match bind(text).unwrap().predicate() {
        BoundPredicate::Binary(e) => e.literal().clone(),
        other => panic!("{text:?} bound as {other}"),
    }
}

#[test]
fn string_literals_take_the_type_of_their_column() {
    assert_eq!(bound_literal("day = '2024-01-31'"), Datum::date_from_str("2024-01-31").unwrap());
    assert_eq!(bound_literal("ts < '2024-01-05T12:00:00'"), Datum::timestamp_from_str("2024-01-05T12:00:00").unwrap());
    assert_eq!(bound_literal("ts < '2024-01-05 12:00:00'"), Datum::timestamp_from_str("2024-01-05T12:00:00").unwrap());
    assert_eq!(bound_literal("ts >= '2024-01-05'"), Datum::timestamp_from_str("2024-01-05T00:00:00").unwrap());
    assert_eq!(
        bound_literal("tstz >= '2024-01-05T12:00:00+02:00'"),
        Datum::timestamptz_from_str("2024-01-05T10:00:00Z").unwrap()
    );
    assert_eq!(
        bound_literal("tstz >= '2024-01-05T12:00:00'"),
        Datum::timestamptz_from_str("2024-01-05T12:00:00Z").unwrap()
    );
    assert_eq!(bound_literal("region = 'eu'"), Datum::string("eu"));
    assert_eq!(bound_literal("n = '42'"), Datum::long(42));
    assert_eq!(bound_literal("qty = '-7'"), Datum::int(-7));
    assert_eq!(bound_literal("flag = 'true'"), Datum::bool(true));
    assert_eq!(
        bound_literal("amount = '3.5'"),
        Datum::decimal_from_str("3.50").unwrap().to(&Type::decimal(9, 2).unwrap()).unwrap()
    );
}

#[test]
fn number_and_boolean_literals_take_the_type_of_their_column() {
    assert_eq!(bound_literal("qty = 7"), Datum::int(7));
    assert_eq!(bound_literal("n = -7"), Datum::long(-7));
    assert_eq!(bound_literal("n = +7"), Datum::long(7));
    assert_eq!(bound_literal("score = 7"), Datum::double(7.0));
    assert_eq!(bound_literal("score < .25"), Datum::double(0.25));
    assert_eq!(bound_literal("flag = false"), Datum::bool(false));
    let two_places = Type::decimal(9, 2).unwrap();
    assert_eq!(bound_literal("amount = 1.5"), Datum::decimal_from_str("1.50").unwrap().to(&two_places).unwrap());
    assert_eq!(bound_literal("amount = 12"), Datum::decimal_from_str("12.00").unwrap().to(&two_places).unwrap());
    assert_eq!(bound_literal("amount = -0.100"), Datum::decimal_from_str("-0.10").unwrap().to(&two_places).unwrap());
    assert_eq!(
        bound_literal("amount = 1234567.89"),
        Datum::decimal_from_str("1234567.89").unwrap().to(&two_places).unwrap()
    );
}

#[test]
fn not_is_pushed_down_to_the_leaves() {
    assert_eq!(bound("not (day >= '2024-01-01' and region = 'eu')"), bound("day < '2024-01-01' or region != 'eu'"));
    assert_eq!(bound("not region in ('a', 'b')"), bound("region not in ('a', 'b')"));
    assert_eq!(bound("not region like 'a%'"), bound("region not like 'a%'"));
    assert_eq!(bound("not not qty = 1"), bound("qty = 1"));
    assert_eq!(bound("not region is null"), bound("region is not null"));
    fn has_not(p: &BoundPredicate) -> bool {
        match p {
            BoundPredicate::Not(_) => true,
            BoundPredicate::And(e) | BoundPredicate::Or(e) => e.inputs().iter().any(|p| has_not(p)),
            _ => false,
        }
    }
    let b = bind("not (qty = 1 or not (region = 'x' and not score is nan))").unwrap();
    assert!(!has_not(b.predicate()), "{}", b.predicate());
    assert!(matches!(b.predicate(), BoundPredicate::And(_)), "{}", b.predicate());
}

#[test]
fn binding_errors_name_the_column_the_literal_and_the_table() {
    let cases = [
        ("nope = 1", "overwrite_filter names column nope, which table db.events does not have"),
        (
            "kind = 'a'",
            "overwrite_filter names column kind, which table db.events does not have (it has Kind; column names are case-sensitive)",
        ),
        (
            "day = '2024-13-01'",
            "overwrite_filter: '2024-13-01' does not fit column day of table db.events, which is date: not a date of the form 'YYYY-MM-DD'",
        ),
        (
            "day = 5",
            "overwrite_filter: 5 does not fit column day of table db.events, which is date: a number is not a date; quote the value",
        ),
        (
            "qty = 3000000000",
            "overwrite_filter: 3000000000 does not fit column qty of table db.events, which is int: not an int: number too large to fit in target type",
        ),
        (
            "qty = 1.5",
            "overwrite_filter: 1.5 does not fit column qty of table db.events, which is int: not an int: invalid digit found in string",
        ),
        (
            "amount = 1.234",
            "overwrite_filter: 1.234 does not fit column amount of table db.events, which is decimal(9, 2): it has more than 2 decimal places",
        ),
        (
            "amount = 12345678.9",
            "overwrite_filter: 12345678.9 does not fit column amount of table db.events, which is decimal(9, 2): it has more than 9 digits",
        ),
        (
            "amount = 'x'",
            "overwrite_filter: 'x' does not fit column amount of table db.events, which is decimal(9, 2): not a decimal number",
        ),
        (
            "flag = 1",
            "overwrite_filter: 1 does not fit column flag of table db.events, which is boolean: a number is not a boolean; write true or false",
        ),
        (
            "region = true",
            "overwrite_filter: true does not fit column region of table db.events, which is string: a boolean is not a value of this type",
        ),
        (
            "region = 5",
            "overwrite_filter: 5 does not fit column region of table db.events, which is string: a number is not a string; quote the value",
        ),
        (
            "ts > 'soon'",
            "overwrite_filter: 'soon' does not fit column ts of table db.events, which is timestamp: not a timestamp of the form 'YYYY-MM-DDTHH:MM:SS[.ffffff]' or 'YYYY-MM-DD'",
        ),
        (
            "region is nan",
            "overwrite_filter: is nan does not fit column region of table db.events, which is string: only float and double columns can be NaN",
        ),
        (
            "qty like 'a%'",
            "overwrite_filter: like 'a%' does not fit column qty of table db.events, which is int: like applies to string columns only",
        ),
        (
            "region in ('a', 5)",
            "overwrite_filter: 5 does not fit column region of table db.events, which is string: a number is not a string; quote the value",
        ),
    ];
    for (text, message) in cases {
        assert_eq!(bind_error(text), message, "for {text:?}");
    }
}

#[test]
fn binding_simplifies_what_the_schema_decides() {
    // `id` is required: `is null` can never hold
    assert_eq!(bind("id is null").unwrap().predicate(), &BoundPredicate::AlwaysFalse);
    assert_eq!(bind("id is not null or qty = 1").unwrap().predicate(), &BoundPredicate::AlwaysTrue);
    assert_eq!(bind("true").unwrap().predicate(), &BoundPredicate::AlwaysTrue);
}

#[test]
fn every_filter_column_must_be_a_partition_source() {
    let by_day = spec(&[("day", "day", Transform::Identity)]);
    let f = bind("day >= '2024-01-01' and region = 'eu'").unwrap();
    assert_eq!(
        f.check_partitioned_by(&by_day).unwrap_err().to_string(),
        "overwrite_filter names column region, which table db.events is not partitioned by; Sluice replaces \
         whole data files, so partition the table by the filter's columns"
    );
    let by_day_and_region = spec(&[("day", "day", Transform::Identity), ("region", "region", Transform::Identity)]);
    f.check_partitioned_by(&by_day_and_region).unwrap();
    let by_ts_day = spec(&[("ts", "ts_day", Transform::Day)]);
    bind("ts < '2024-01-05T12:00:00'").unwrap().check_partitioned_by(&by_ts_day).unwrap();
    assert!(matches!(
        bind("day = '2024-01-01'").unwrap().check_partitioned_by(&by_ts_day),
        Err(FilterError::NotPartitioned { column, .. }) if column == "day"
    ));
    // a void transform partitions nothing
    let void = spec(&[("day", "day_void", Transform::Void)]);
    assert!(bind("day = '2024-01-01'").unwrap().check_partitioned_by(&void).is_err());
    // a filter without columns needs no partitioning
    bind("true").unwrap().check_partitioned_by(&PartitionSpec::unpartition_spec()).unwrap();
}

fn date(s: &str) -> Literal {
    match Datum::date_from_str(s).unwrap().literal() {
        iceberg::spec::PrimitiveLiteral::Int(d) => Literal::date(*d),
        other => panic!("{other:?}"),
    }
}

fn classify(filter: &str, spec: &PartitionSpec, partition: Vec<Option<Literal>>) -> Placement {
    let f = bind(filter).unwrap();
    f.check_partitioned_by(spec).unwrap();
    f.project(spec).unwrap().classify(&Struct::from_iter(partition)).unwrap()
}

#[test]
fn a_month_of_days_on_an_identity_partition() {
    let by_day = spec(&[("day", "day", Transform::Identity)]);
    let january = "day >= '2024-01-01' and day < '2024-02-01'";
    assert_eq!(classify(january, &by_day, vec![Some(date("2023-12-31"))]), Placement::Outside);
    assert_eq!(classify(january, &by_day, vec![Some(date("2024-01-01"))]), Placement::Inside);
    assert_eq!(classify(january, &by_day, vec![Some(date("2024-01-31"))]), Placement::Inside);
    assert_eq!(classify(january, &by_day, vec![Some(date("2024-02-01"))]), Placement::Outside);
    assert_eq!(classify(january, &by_day, vec![None]), Placement::Outside, "null days are outside the filter");
    assert_eq!(classify("day is null", &by_day, vec![None]), Placement::Inside);
    assert_eq!(classify("day is null", &by_day, vec![Some(date("2024-01-01"))]), Placement::Outside);
    let days = "day in ('2024-01-03', '2024-01-05')";
    assert_eq!(classify(days, &by_day, vec![Some(date("2024-01-05"))]), Placement::Inside);
    assert_eq!(classify(days, &by_day, vec![Some(date("2024-01-04"))]), Placement::Outside);
    let but = "not (day = '2024-01-04')";
    assert_eq!(classify(but, &by_day, vec![Some(date("2024-01-04"))]), Placement::Outside);
    assert_eq!(classify(but, &by_day, vec![Some(date("2024-01-05"))]), Placement::Inside);
}

#[test]
fn a_month_of_days_on_a_day_transform_of_a_timestamp() {
    let by_ts_day = spec(&[("ts", "ts_day", Transform::Day)]);
    let january = "ts >= '2024-01-01T00:00:00' and ts < '2024-02-01T00:00:00'";
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2023-12-31"))]), Placement::Outside);
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2024-01-01"))]), Placement::Inside);
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2024-01-31"))]), Placement::Inside);
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2024-02-01"))]), Placement::Outside);
    // the same month written with bare dates
    let january = "ts >= '2024-01-01' and ts < '2024-02-01'";
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2024-01-01"))]), Placement::Inside);
    assert_eq!(classify(january, &by_ts_day, vec![Some(date("2024-02-01"))]), Placement::Outside);
}

#[test]
fn a_cut_inside_a_day_straddles_that_days_partition() {
    let by_ts_day = spec(&[("ts", "ts_day", Transform::Day)]);
    let before_noon = "ts < '2024-01-05T12:00:00'";
    assert_eq!(classify(before_noon, &by_ts_day, vec![Some(date("2024-01-04"))]), Placement::Inside);
    assert_eq!(classify(before_noon, &by_ts_day, vec![Some(date("2024-01-05"))]), Placement::Straddles);
    assert_eq!(classify(before_noon, &by_ts_day, vec![Some(date("2024-01-06"))]), Placement::Outside);
    // one instant: some rows of that day may match, never all
    let instant = "ts = '2024-01-05T12:00:00'";
    assert_eq!(classify(instant, &by_ts_day, vec![Some(date("2024-01-05"))]), Placement::Straddles);
    assert_eq!(classify(instant, &by_ts_day, vec![Some(date("2024-01-06"))]), Placement::Outside);
}

#[test]
fn string_partitions_with_in_like_and_not() {
    let by_region = spec(&[("region", "region", Transform::Identity)]);
    let eu = || vec![Some(Literal::string("eu-west"))];
    let us = || vec![Some(Literal::string("us"))];
    assert_eq!(classify("region in ('us', 'eu-west')", &by_region, eu()), Placement::Inside);
    assert_eq!(classify("region not in ('us', 'ap')", &by_region, eu()), Placement::Inside);
    assert_eq!(classify("region not in ('us', 'ap')", &by_region, us()), Placement::Outside);
    assert_eq!(classify("region like 'eu-%'", &by_region, eu()), Placement::Inside);
    assert_eq!(classify("region like 'eu-%'", &by_region, us()), Placement::Outside);
    assert_eq!(classify("region not like 'eu-%'", &by_region, us()), Placement::Inside);
    assert_eq!(classify("not region = 'us'", &by_region, us()), Placement::Outside);
    assert_eq!(classify("'us' = region", &by_region, us()), Placement::Inside);
}

/// iceberg-rust 0.10.1 projects a `starts with` through `truncate[W]` by
/// the prefix's byte length, while truncating counts characters; a prefix
/// outside ASCII is therefore not projected at all, and its partitions
/// straddle (refused) rather than being kept while they hold matching rows.
#[test]
fn a_non_ascii_prefix_on_a_truncated_string_straddles() {
    let by_trunc = spec(&[("region", "region_trunc", Transform::Truncate(2))]);
    let p = |v: &str| vec![Some(Literal::string(v))];
    // 'é' is one character and two bytes: partitions 'éa' and 'éb' both hold matching rows
    assert_eq!(classify("region like 'é%'", &by_trunc, p("éa")), Placement::Straddles);
    assert_eq!(classify("region like 'é%'", &by_trunc, p("éb")), Placement::Straddles);
    assert_eq!(classify("region not like 'é%'", &by_trunc, p("éa")), Placement::Straddles);
    // an ASCII prefix keeps iceberg's projection: 'eu' under truncate[2] is exact
    assert_eq!(classify("region like 'eu%'", &by_trunc, p("eu")), Placement::Inside);
    assert_eq!(classify("region like 'eu%'", &by_trunc, p("us")), Placement::Outside);
}

#[test]
fn two_partition_columns() {
    let by_day_region = spec(&[("day", "day", Transform::Identity), ("region", "region", Transform::Identity)]);
    let p = |d: &str, r: &str| vec![Some(date(d)), Some(Literal::string(r))];
    let f = "day = '2024-01-01' and region = 'eu'";
    assert_eq!(classify(f, &by_day_region, p("2024-01-01", "eu")), Placement::Inside);
    assert_eq!(classify(f, &by_day_region, p("2024-01-01", "us")), Placement::Outside);
    let f = "day = '2024-01-01' or region = 'eu'";
    assert_eq!(classify(f, &by_day_region, p("2024-01-02", "eu")), Placement::Inside);
    assert_eq!(classify(f, &by_day_region, p("2024-01-02", "us")), Placement::Outside);
    // a null region is unknown: `or` with a true side still holds
    assert_eq!(classify(f, &by_day_region, vec![Some(date("2024-01-01")), None]), Placement::Inside);
    assert_eq!(classify(f, &by_day_region, vec![Some(date("2024-01-02")), None]), Placement::Outside);
}

#[test]
fn a_bucket_partition_never_holds_only_matching_rows_of_an_equality() {
    let by_bucket = spec(&[("qty", "qty_bucket", Transform::Bucket(16))]);
    let bucket = |v: i32| {
        let d = create_transform_function(&Transform::Bucket(16)).unwrap().transform_literal(&Datum::int(v)).unwrap();
        Literal::from(d.unwrap())
    };
    assert_eq!(classify("qty = 5", &by_bucket, vec![Some(bucket(5))]), Placement::Straddles);
    let other = (0..100).map(bucket).find(|b| *b != bucket(5)).unwrap();
    assert_eq!(classify("qty = 5", &by_bucket, vec![Some(other)]), Placement::Outside);
    // a range cannot be projected onto buckets: every bucket may match
    assert_eq!(classify("qty < 5", &by_bucket, vec![Some(bucket(5))]), Placement::Straddles);
}

#[test]
fn true_replaces_every_partition_of_an_unpartitioned_table() {
    assert_eq!(classify("true", &PartitionSpec::unpartition_spec(), vec![]), Placement::Inside);
    assert_eq!(classify("false", &PartitionSpec::unpartition_spec(), vec![]), Placement::Outside);
}

#[test]
fn a_tuple_of_another_shape_is_an_error() {
    let by_day_region = spec(&[("day", "day", Transform::Identity), ("region", "region", Transform::Identity)]);
    let f = bind("region = 'eu'").unwrap().project(&by_day_region).unwrap();
    assert_eq!(f.spec_id(), 1);
    let err = f.classify(&Struct::from_iter([Some(date("2024-01-01"))])).unwrap_err().to_string();
    assert_eq!(
        err,
        "overwrite_filter `region = 'eu'` on table db.events: a partition tuple of 1 values does not fit spec 1 (2 fields)"
    );
}

/// A batch of the table's Arrow schema restricted to `columns`.
fn batch(columns: Vec<(&str, ArrayRef)>) -> RecordBatch {
    let arrow = iceberg::arrow::schema_to_arrow_schema(&schema()).unwrap();
    let fields: Vec<Field> = columns.iter().map(|(n, _)| arrow.field_with_name(n).unwrap().clone()).collect();
    RecordBatch::try_new(Arc::new(ArrowSchema::new(fields)), columns.into_iter().map(|(_, a)| a).collect()).unwrap()
}

fn days(values: &[Option<&str>]) -> ArrayRef {
    let v = values.iter().map(|d| {
        d.map(|d| match Datum::date_from_str(d).unwrap().literal() {
            iceberg::spec::PrimitiveLiteral::Int(n) => *n,
            other => panic!("{other:?}"),
        })
    });
    Arc::new(Date32Array::from_iter(v))
}

fn micros(s: &str) -> i64 {
    match Datum::timestamp_from_str(s).unwrap().literal() {
        iceberg::spec::PrimitiveLiteral::Long(n) => *n,
        other => panic!("{other:?}"),
    }
}

fn outside(filter: &str, batch: &RecordBatch) -> Option<(usize, String)> {
    bind(filter).unwrap().first_row_outside(batch).unwrap().map(|r| (r.row, r.to_string()))
}

#[test]
fn the_row_check_finds_the_first_row_outside_the_filter() {
    let january = "day >= '2024-01-01' and day < '2024-02-01'";
    let b =
        batch(vec![("day", days(&[Some("2024-01-01"), Some("2024-01-31"), Some("2024-02-03"), Some("2023-12-31")]))]);
    assert_eq!(outside(january, &b), Some((2, "day = 2024-02-03".into())));
    let b = batch(vec![("day", days(&[Some("2024-01-01"), Some("2024-01-31")]))]);
    assert_eq!(outside(january, &b), None);
    // a null is outside: the filter is unknown for it
    let b = batch(vec![("day", days(&[Some("2024-01-02"), None]))]);
    assert_eq!(outside(january, &b), Some((1, "day = null".into())));
    assert_eq!(outside("day is null or day = '2024-01-02'", &b), None);
    assert_eq!(outside("not (day < '2024-01-01')", &b), Some((1, "day = null".into())));
    // an empty batch has nothing outside
    assert_eq!(outside(january, &batch(vec![("day", days(&[]))])), None);
}

#[test]
fn the_row_check_renders_every_filter_column_of_the_row() {
    let b = batch(vec![
        ("day", days(&[Some("2024-01-01"), Some("2024-01-01")])),
        ("region", Arc::new(StringArray::from(vec![Some("eu"), Some("us")])) as ArrayRef),
        ("score", Arc::new(Float64Array::from(vec![1.0, f64::NAN])) as ArrayRef),
    ]);
    assert_eq!(
        outside("day = '2024-01-01' and region in ('eu', 'ap')", &b),
        Some((1, "day = 2024-01-01, region = us".into()))
    );
    assert_eq!(outside("region like 'e%'", &b), Some((1, "region = us".into())));
    assert_eq!(outside("region not like 'e%'", &b), Some((0, "region = eu".into())));
    assert_eq!(outside("region not in ('us')", &b), Some((1, "region = us".into())));
    assert_eq!(outside("region != 'eu'", &b), Some((0, "region = eu".into())));
    assert_eq!(outside("score is not nan", &b), Some((1, "score = NaN".into())));
    assert_eq!(outside("score is nan", &b), Some((0, "score = 1.0".into())));
    assert_eq!(outside("true", &b), None);
    assert_eq!(outside("false", &b), Some((0, String::new())));
}

#[test]
fn the_row_check_compares_timestamps_decimals_and_other_string_flavours() {
    let ts = TimestampMicrosecondArray::from(vec![micros("2024-01-05T11:59:59"), micros("2024-01-05T12:00:00")]);
    let tstz = TimestampMicrosecondArray::from(vec![micros("2024-01-05T09:00:00"), micros("2024-01-05T11:00:00")])
        .with_timezone("+00:00");
    let amount = Decimal128Array::from(vec![150, 149]).with_precision_and_scale(9, 2).unwrap();
    let b = batch(vec![
        ("ts", Arc::new(ts) as ArrayRef),
        ("tstz", Arc::new(tstz) as ArrayRef),
        ("amount", Arc::new(amount) as ArrayRef),
    ]);
    assert_eq!(outside("ts < '2024-01-05T12:00:00'", &b), Some((1, "ts = 2024-01-05T12:00:00".into())));
    assert_eq!(outside("tstz < '2024-01-05T12:00:00+02:00'", &b), Some((1, "tstz = 2024-01-05T11:00:00Z".into())));
    assert_eq!(outside("amount >= 1.5", &b), Some((1, "amount = 1.49".into())));
    // a column whose Arrow type is another flavour of the Iceberg type
    let region: ArrayRef = Arc::new(LargeStringArray::from(vec!["eu", "us"]));
    let large = RecordBatch::try_new(
        Arc::new(ArrowSchema::new(vec![Field::new("region", DataType::LargeUtf8, true)])),
        vec![region],
    )
    .unwrap();
    assert_eq!(outside("region = 'eu'", &large), Some((1, "region = us".into())));
    assert_eq!(outside("region like 'e%'", &large), Some((1, "region = us".into())));
    // the batch lacks the column
    let err = bind("qty = 1").unwrap().first_row_outside(&large).unwrap_err().to_string();
    assert_eq!(err, "overwrite_filter `qty = 1` on table db.events: the batch to check has no column qty");
}

#[test]
fn deep_nesting_and_long_filters_are_refused_before_they_reach_the_stack() {
    let deep = format!("{}a = 1{}", "(".repeat(65), ")".repeat(65));
    assert_eq!(parse_error(&deep), "overwrite_filter: at character 65: more than 64 nested 'not's and parentheses");
    let fine = format!("{}a = 1{}", "(".repeat(64), ")".repeat(64));
    assert_eq!(parsed(&fine), "(= a int:1)");
    let nots = format!("{}a = 1", "not ".repeat(65));
    assert_eq!(parse_error(&nots), "overwrite_filter: at character 257: more than 64 nested 'not's and parentheses");
    let long = vec!["a = 1"; 1025].join(" or ");
    assert_eq!(parse_error(&long), "overwrite_filter: at character 9217: more than 1024 predicates");
}

/// The deepest filters the grammar admits go through every step on a 1 MiB
/// stack, a wasm32 plugin's (Rust's default for wasm targets), in a debug
/// build whose frames are larger than the plugin's release ones.
#[test]
fn the_deepest_filters_fit_a_plugins_stack() {
    // (qty = 1 or (qty != 2 and (qty = 3 or … (qty = 63 or qty = 64)…))), 64 levels
    let mut nested = String::from("qty = 64");
    for i in (1..64).rev() {
        nested = if i % 2 == 1 { format!("(qty = {i} or {nested})") } else { format!("(qty != {i} and {nested})") };
    }
    // the same, evaluated directly
    fn expected(i: i32, v: i32) -> bool {
        match i {
            64 => v == 64,
            i if i % 2 == 1 => v == i || expected(i + 1, v),
            i => v != i && expected(i + 1, v),
        }
    }
    let chain = vec!["qty = 1"; 1024].join(" or ");
    let nots = format!("{}qty = 1", "not ".repeat(64));
    let values = [1, 3, 64, 2, 65];
    let worker = std::thread::Builder::new()
        .stack_size(1 << 20)
        .spawn(move || {
            let by_qty = spec(&[("qty", "qty", Transform::Identity)]);
            let qty: ArrayRef = Arc::new(arrow_array::Int32Array::from(values.to_vec()));
            let b = batch(vec![("qty", qty)]);
            let mut out = Vec::new();
            for text in [nested, chain, nots] {
                let f = bind(&text).unwrap();
                let p = f.project(&by_qty).unwrap();
                let placements: Vec<Placement> =
                    values.iter().map(|v| p.classify(&Struct::from_iter([Some(Literal::int(*v))])).unwrap()).collect();
                out.push((placements, f.first_row_outside(&b).unwrap().map(|r| r.row)));
            }
            out
        })
        .unwrap();
    let results = worker.join().unwrap();
    let placement = |inside: bool| if inside { Placement::Inside } else { Placement::Outside };
    let nested_expected: Vec<Placement> = values.iter().map(|v| placement(expected(1, *v))).collect();
    assert_eq!(
        nested_expected,
        vec![Placement::Inside, Placement::Inside, Placement::Inside, Placement::Outside, Placement::Outside]
    );
    assert_eq!(results[0], (nested_expected, Some(3)));
    let only_one = values.iter().map(|v| placement(*v == 1)).collect::<Vec<_>>();
    assert_eq!(results[1], (only_one.clone(), Some(1)), "1024 times qty = 1");
    assert_eq!(results[2], (only_one, Some(1)), "64 nots: an even number");
}
