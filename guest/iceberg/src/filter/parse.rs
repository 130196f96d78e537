//! The `overwrite_filter` grammar: a hand-written recursive descent parser for
//! the subset of PyIceberg's string filters (`pyiceberg/expressions/parser.py`)
//! that names columns. iceberg-rust 0.10 has no string predicate parser.
//!
//! ```text
//! filter     := or END
//! or         := and ("or" and)*
//! and        := not ("and" not)*
//! not        := "not" not | "(" or ")" | predicate
//! predicate  := "true" | "false"
//!             | column cmp literal | literal cmp column
//!             | column "is" ["not"] ("null" | "nan")
//!             | column ["not"] "in" "(" literal ("," literal)* ")"
//!             | column ["not"] "like" string
//! cmp        := "<" | "<=" | ">" | ">=" | "=" | "==" | "!=" | "<>"
//! column     := [A-Za-z_][A-Za-z0-9_$]* | '"' [^"]+ '"'
//! literal    := string | decimal | integer | "true" | "false"
//! string     := "'" ([^'] | "''")* "'"
//! decimal    := [+-]? ([0-9]+ "." [0-9]* | "." [0-9]+)
//! integer    := [+-]? [0-9]+
//! ```
//!
//! Keywords are case-insensitive; a column named like a keyword is written
//! double-quoted. A literal on the left flips the operator (`5 < x` is
//! `x > 5`). As in PyIceberg, `like` takes one unescaped `%` at the end only
//! (starts-with); `\%` is a literal `%`, `_` is no wildcard, and a pattern
//! without `%` is an equality. PyIceberg's deprecated `table.column` prefix is
//! not accepted.
//!
//! `and` and `or` chains become balanced trees, a filter nests at most 64
//! `not`s and parentheses and holds at most 1024 predicates (a long list of
//! values is better one `in (…)`): so no recursive walk of it, here or in
//! iceberg (whose `bind` and `rewrite_not` recurse), nears the end of a
//! plugin's stack.

use super::{FilterError, character_at};

/// A column as written, with its byte offset.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Column {
    pub(super) name: String,
    pub(super) at: usize,
}

/// A literal's value, kept as written until binding gives it a type.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum LitValue {
    Str(String),
    /// `[+-]?[0-9]+`, as written.
    Int(String),
    /// `[+-]?[0-9]*.[0-9]*`, as written.
    Dec(String),
    Bool(bool),
}

/// A literal with its byte offset.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Lit {
    pub(super) value: LitValue,
    pub(super) at: usize,
}

/// A comparison operator, with the column on its left.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CmpOp {
    Lt,
    LtEq,
    Gt,
    GtEq,
    Eq,
    NotEq,
}

impl CmpOp {
    /// The operator that keeps the meaning when the operands swap sides.
    fn flipped(self) -> Self {
        match self {
            CmpOp::Lt => CmpOp::Gt,
            CmpOp::LtEq => CmpOp::GtEq,
            CmpOp::Gt => CmpOp::Lt,
            CmpOp::GtEq => CmpOp::LtEq,
            CmpOp::Eq => CmpOp::Eq,
            CmpOp::NotEq => CmpOp::NotEq,
        }
    }
}

/// The parsed filter.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Expr {
    Always(bool),
    And(Box<Expr>, Box<Expr>),
    Or(Box<Expr>, Box<Expr>),
    Not(Box<Expr>),
    Compare { column: Column, op: CmpOp, literal: Lit },
    In { column: Column, negated: bool, literals: Vec<Lit> },
    Null { column: Column, negated: bool },
    Nan { column: Column, negated: bool },
    StartsWith { column: Column, negated: bool, prefix: String, at: usize },
}

impl Expr {
    /// Calls `f` with every column name, in order of appearance.
    pub(super) fn visit_columns<'a>(&'a self, f: &mut impl FnMut(&'a str)) {
        match self {
            Expr::Always(_) => {}
            Expr::And(l, r) | Expr::Or(l, r) => {
                l.visit_columns(f);
                r.visit_columns(f);
            }
            Expr::Not(e) => e.visit_columns(f),
            Expr::Compare { column, .. }
            | Expr::In { column, .. }
            | Expr::Null { column, .. }
            | Expr::Nan { column, .. }
            | Expr::StartsWith { column, .. } => f(&column.name),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keyword {
    And,
    Or,
    Not,
    Is,
    In,
    Null,
    Nan,
    Like,
    True,
    False,
}

impl Keyword {
    fn from_word(word: &str) -> Option<Self> {
        const ALL: [(&str, Keyword); 10] = [
            ("and", Keyword::And),
            ("or", Keyword::Or),
            ("not", Keyword::Not),
            ("is", Keyword::Is),
            ("in", Keyword::In),
            ("null", Keyword::Null),
            ("nan", Keyword::Nan),
            ("like", Keyword::Like),
            ("true", Keyword::True),
            ("false", Keyword::False),
        ];
        ALL.iter().find(|(w, _)| w.eq_ignore_ascii_case(word)).map(|(_, k)| *k)
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Keyword(Keyword),
    Str(String),
    Int(String),
    Dec(String),
    Cmp(CmpOp),
    LParen,
    RParen,
    Comma,
    /// Text the lexer could not read; lexing stops there. `expected` is set
    /// when the lexer knows better than the parser what should have been
    /// there (a closing quote, a well-formed number).
    Bad {
        expected: Option<String>,
    },
    End,
}

/// A token, its byte offset and its source text.
#[derive(Debug, Clone)]
struct Token<'a> {
    tok: Tok,
    at: usize,
    text: &'a str,
    /// How a `Bad` token is shown.
    found: Option<String>,
}

impl Token<'_> {
    /// How the token is shown after "found".
    fn shown(&self) -> String {
        if let Some(found) = &self.found {
            return found.clone();
        }
        match &self.tok {
            Tok::End => "the end of the filter".into(),
            Tok::Ident(_) => format!("column {}", self.text),
            Tok::Str(_) => format!("the string {}", self.text),
            Tok::Int(_) | Tok::Dec(_) => format!("the number {}", self.text),
            _ => format!("'{}'", self.text),
        }
    }
}

fn syntax(source: &str, at: usize, expected: impl Into<String>, found: impl Into<String>) -> FilterError {
    FilterError::Syntax {
        offset: at,
        character: character_at(source, at),
        expected: expected.into(),
        found: found.into(),
    }
}

fn unsupported(source: &str, at: usize, problem: impl Into<String>) -> FilterError {
    FilterError::Unsupported { offset: at, character: character_at(source, at), problem: problem.into() }
}

/// The first character of `source[at..]`, quoted, or "the end of the filter".
fn char_at(source: &str, at: usize) -> String {
    source
        .get(at..)
        .and_then(|rest| rest.chars().next())
        .map_or_else(|| "the end of the filter".into(), |c| format!("'{c}'"))
}

/// Splits `source` into tokens, ending with `End`. Text that is no token
/// becomes one `Bad` token, after which lexing stops: the parser reports it
/// with what it expected there.
fn lex(source: &str) -> Vec<Token<'_>> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        let c = bytes[i];
        // (token, its end), or a bad token: (expected, found, where)
        let lexed: Result<(Tok, usize), (Option<String>, String, usize)> = match c {
            b' ' | b'\t' | b'\n' | b'\r' => {
                i += 1;
                continue;
            }
            b'(' => Ok((Tok::LParen, i + 1)),
            b')' => Ok((Tok::RParen, i + 1)),
            b',' => Ok((Tok::Comma, i + 1)),
            b'<' | b'>' | b'=' | b'!' => match (c, bytes.get(i + 1).copied()) {
                (b'<', Some(b'=')) => Ok((Tok::Cmp(CmpOp::LtEq), i + 2)),
                (b'<', Some(b'>')) => Ok((Tok::Cmp(CmpOp::NotEq), i + 2)),
                (b'<', _) => Ok((Tok::Cmp(CmpOp::Lt), i + 1)),
                (b'>', Some(b'=')) => Ok((Tok::Cmp(CmpOp::GtEq), i + 2)),
                (b'>', _) => Ok((Tok::Cmp(CmpOp::Gt), i + 1)),
                (b'=', Some(b'=')) => Ok((Tok::Cmp(CmpOp::Eq), i + 2)),
                (b'=', _) => Ok((Tok::Cmp(CmpOp::Eq), i + 1)),
                (b'!', Some(b'=')) => Ok((Tok::Cmp(CmpOp::NotEq), i + 2)),
                _ => Err((Some("'!='".into()), "'!'".into(), i)),
            },
            b'\'' => lex_string(source, i),
            b'"' => match source[i + 1..].find('"') {
                None => Err((
                    Some(format!("\" to close the column name that starts at character {}", character_at(source, i))),
                    "the end of the filter".into(),
                    source.len(),
                )),
                Some(0) => Err((Some("a column name between the double quotes".into()), "\"\"".into(), i)),
                Some(len) => Ok((Tok::Ident(source[i + 1..i + 1 + len].to_owned()), i + len + 2)),
            },
            b'+' | b'-' | b'.' | b'0'..=b'9' => lex_number(source, i),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let mut j = i + 1;
                while bytes.get(j).is_some_and(|b| b.is_ascii_alphanumeric() || *b == b'_' || *b == b'$') {
                    j += 1;
                }
                let word = &source[i..j];
                let tok = Keyword::from_word(word).map_or_else(|| Tok::Ident(word.to_owned()), Tok::Keyword);
                Ok((tok, j))
            }
            _ => Err((None, char_at(source, i), i)),
        };
        match lexed {
            Ok((tok, end)) => {
                out.push(Token { tok, at: start, text: &source[start..end], found: None });
                i = end;
            }
            Err((expected, found, at)) => {
                out.push(Token { tok: Tok::Bad { expected }, at, text: "", found: Some(found) });
                break;
            }
        }
    }
    out.push(Token { tok: Tok::End, at: source.len(), text: "", found: None });
    out
}

/// A single-quoted string starting at `i`, `''` standing for one quote.
fn lex_string(source: &str, i: usize) -> Result<(Tok, usize), (Option<String>, String, usize)> {
    let mut value = String::new();
    let mut j = i + 1;
    loop {
        let Some(len) = source[j..].find('\'') else {
            let expected = format!("' to close the string that starts at character {}", character_at(source, i));
            return Err((Some(expected), "the end of the filter".into(), source.len()));
        };
        value.push_str(&source[j..j + len]);
        j += len + 1;
        if source.as_bytes().get(j) == Some(&b'\'') {
            value.push('\'');
            j += 1;
        } else {
            return Ok((Tok::Str(value), j));
        }
    }
}

/// `[+-]?[0-9]+` or `[+-]?([0-9]+.[0-9]*|.[0-9]+)` starting at `i`.
fn lex_number(source: &str, i: usize) -> Result<(Tok, usize), (Option<String>, String, usize)> {
    let bytes = source.as_bytes();
    let mut j = i;
    if matches!(bytes.get(j), Some(b'+' | b'-')) {
        j += 1;
    }
    let digits = |mut j: usize| {
        while bytes.get(j).is_some_and(u8::is_ascii_digit) {
            j += 1;
        }
        j
    };
    let int_end = digits(j);
    let int_digits = int_end - j;
    j = int_end;
    let mut decimal = false;
    let mut frac_digits = 0;
    if bytes.get(j) == Some(&b'.') {
        decimal = true;
        let frac_end = digits(j + 1);
        frac_digits = frac_end - j - 1;
        j = frac_end;
    }
    if int_digits == 0 && frac_digits == 0 {
        return Err((None, char_at(source, i), i));
    }
    if bytes.get(j).is_some_and(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'$' | b'.')) {
        let end =
            source[j..].find(|c: char| c.is_whitespace() || "()<>=!,'\"".contains(c)).map_or(source.len(), |e| j + e);
        return Err((Some("a number".into()), format!("'{}'", &source[i..end]), i));
    }
    let text = source[i..j].to_owned();
    Ok((if decimal { Tok::Dec(text) } else { Tok::Int(text) }, j))
}

/// Bounds that keep every recursive walk of a filter (here, in binding, in
/// projection, in evaluation) far from the stack's end.
const MAX_NESTING: usize = 64;
const MAX_PREDICATES: usize = 1024;

/// A chain `a op b op c …` of an associative `op` as a balanced tree, so
/// that its depth grows with the logarithm of its length (`a op b op c` is
/// still `(a op b) op c`).
fn balanced(mut operands: Vec<Expr>, op: fn(Box<Expr>, Box<Expr>) -> Expr) -> Expr {
    if operands.len() <= 1 {
        // `and` and `or` always hand over at least one operand
        return operands.pop().unwrap_or(Expr::Always(true));
    }
    let right = operands.split_off(operands.len().div_ceil(2));
    op(Box::new(balanced(operands, op)), Box::new(balanced(right, op)))
}

struct Parser<'a> {
    source: &'a str,
    tokens: Vec<Token<'a>>,
    pos: usize,
    /// `not`s and parentheses open around the next token.
    nesting: usize,
    predicates: usize,
}

/// Parses a whole filter.
pub(super) fn parse(source: &str) -> Result<Expr, FilterError> {
    let tokens = lex(source);
    if tokens.len() == 1 {
        return Err(syntax(source, 0, "a predicate such as day = '2024-01-31'", "an empty filter"));
    }
    let mut p = Parser { source, tokens, pos: 0, nesting: 0, predicates: 0 };
    let expr = p.or()?;
    if p.peek().tok != Tok::End {
        return Err(p.expected("'and', 'or' or the end of the filter"));
    }
    Ok(expr)
}

impl<'a> Parser<'a> {
    fn peek(&self) -> &Token<'a> {
        // `lex` always ends the list with `End`, and `bump` never moves past it.
        &self.tokens[self.pos.min(self.tokens.len() - 1)]
    }

    fn peek_at(&self, ahead: usize) -> &Tok {
        &self.tokens[(self.pos + ahead).min(self.tokens.len() - 1)].tok
    }

    fn bump(&mut self) -> Token<'a> {
        let t = self.peek().clone();
        if t.tok != Tok::End {
            self.pos += 1;
        }
        t
    }

    fn eat_keyword(&mut self, k: Keyword) -> bool {
        if self.peek().tok == Tok::Keyword(k) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// A syntax error at the next token: `expected` was to come there. A
    /// token the lexer could not read may say itself what was expected.
    fn expected(&self, expected: impl Into<String>) -> FilterError {
        let t = self.peek();
        match &t.tok {
            Tok::Bad { expected: Some(own) } => syntax(self.source, t.at, own.clone(), t.shown()),
            _ => syntax(self.source, t.at, expected, t.shown()),
        }
    }

    fn or(&mut self) -> Result<Expr, FilterError> {
        let mut operands = vec![self.and()?];
        while self.eat_keyword(Keyword::Or) {
            operands.push(self.and()?);
        }
        Ok(balanced(operands, Expr::Or))
    }

    fn and(&mut self) -> Result<Expr, FilterError> {
        let mut operands = vec![self.not()?];
        while self.eat_keyword(Keyword::And) {
            operands.push(self.not()?);
        }
        Ok(balanced(operands, Expr::And))
    }

    fn not(&mut self) -> Result<Expr, FilterError> {
        if matches!(self.peek().tok, Tok::LParen | Tok::Keyword(Keyword::Not)) {
            self.nesting += 1;
            if self.nesting > MAX_NESTING {
                let at = self.peek().at;
                return Err(unsupported(
                    self.source,
                    at,
                    format!("more than {MAX_NESTING} nested 'not's and parentheses"),
                ));
            }
            let inner = self.nested();
            self.nesting -= 1;
            return inner;
        }
        self.predicates += 1;
        if self.predicates > MAX_PREDICATES {
            let at = self.peek().at;
            return Err(unsupported(self.source, at, format!("more than {MAX_PREDICATES} predicates")));
        }
        self.predicate()
    }

    /// `not …` or `( … )`.
    fn nested(&mut self) -> Result<Expr, FilterError> {
        if self.eat_keyword(Keyword::Not) {
            return Ok(Expr::Not(Box::new(self.not()?)));
        }
        let open = self.bump();
        let inner = self.or()?;
        if self.peek().tok != Tok::RParen {
            let expected = format!("')' to close the '(' at character {}", character_at(self.source, open.at));
            let expected = if self.peek().tok == Tok::End { expected } else { format!("'and', 'or' or {expected}") };
            return Err(self.expected(expected));
        }
        self.bump();
        Ok(inner)
    }

    fn predicate(&mut self) -> Result<Expr, FilterError> {
        let t = self.peek().clone();
        match &t.tok {
            Tok::Ident(name) => {
                self.bump();
                self.after_column(Column { name: name.clone(), at: t.at })
            }
            Tok::Keyword(k @ (Keyword::True | Keyword::False)) if !matches!(self.peek_at(1), Tok::Cmp(_)) => {
                self.bump();
                Ok(Expr::Always(*k == Keyword::True))
            }
            Tok::Str(_) | Tok::Int(_) | Tok::Dec(_) | Tok::Keyword(Keyword::True | Keyword::False) => {
                let literal = self.literal("a literal")?;
                let op_tok = self.peek().clone();
                let Tok::Cmp(op) = op_tok.tok else {
                    return Err(self.expected(format!("a comparison operator (< <= > >= = == != <>) after {}", t.text)));
                };
                self.bump();
                let column = self.column(&format!("a column after '{}'", op_tok.text))?;
                Ok(Expr::Compare { column, op: op.flipped(), literal })
            }
            _ => Err(self.expected("a column, a literal, 'not' or '('")),
        }
    }

    fn column(&mut self, expected: &str) -> Result<Column, FilterError> {
        let t = self.peek().clone();
        match t.tok {
            Tok::Ident(name) => {
                self.bump();
                Ok(Column { name, at: t.at })
            }
            _ => Err(self.expected(expected)),
        }
    }

    fn literal(&mut self, expected: &str) -> Result<Lit, FilterError> {
        let t = self.peek().clone();
        let value = match t.tok {
            Tok::Str(s) => LitValue::Str(s),
            Tok::Int(s) => LitValue::Int(s),
            Tok::Dec(s) => LitValue::Dec(s),
            Tok::Keyword(Keyword::True) => LitValue::Bool(true),
            Tok::Keyword(Keyword::False) => LitValue::Bool(false),
            _ => return Err(self.expected(expected)),
        };
        self.bump();
        Ok(Lit { value, at: t.at })
    }

    fn after_column(&mut self, column: Column) -> Result<Expr, FilterError> {
        let t = self.peek().clone();
        match t.tok {
            Tok::Cmp(op) => {
                self.bump();
                let literal = self.literal(&format!("a literal after '{}'", t.text))?;
                Ok(Expr::Compare { column, op, literal })
            }
            Tok::Keyword(Keyword::Is) => {
                self.bump();
                let negated = self.eat_keyword(Keyword::Not);
                let after = if negated { "'is not'" } else { "'is'" };
                if self.eat_keyword(Keyword::Null) {
                    Ok(Expr::Null { column, negated })
                } else if self.eat_keyword(Keyword::Nan) {
                    Ok(Expr::Nan { column, negated })
                } else {
                    Err(self.expected(format!("'null' or 'nan' after {after}")))
                }
            }
            Tok::Keyword(Keyword::In) => {
                self.bump();
                self.in_list(column, false)
            }
            Tok::Keyword(Keyword::Like) => {
                self.bump();
                self.like(column, false)
            }
            Tok::Keyword(Keyword::Not) => {
                self.bump();
                if self.eat_keyword(Keyword::In) {
                    self.in_list(column, true)
                } else if self.eat_keyword(Keyword::Like) {
                    self.like(column, true)
                } else {
                    Err(self.expected("'in' or 'like' after 'not'"))
                }
            }
            _ => Err(self.expected(format!(
                "an operator after column {} (< <= > >= = == != <>, in, not in, is, like)",
                column.name
            ))),
        }
    }

    fn in_list(&mut self, column: Column, negated: bool) -> Result<Expr, FilterError> {
        let keyword = if negated { "'not in'" } else { "'in'" };
        if self.peek().tok != Tok::LParen {
            return Err(self.expected(format!("'(' after {keyword}")));
        }
        self.bump();
        let mut literals = vec![self.literal(&format!("a literal in the list after {keyword}"))?];
        loop {
            match self.peek().tok {
                Tok::Comma => {
                    self.bump();
                    literals.push(self.literal("a literal after ','")?);
                }
                Tok::RParen => {
                    self.bump();
                    return Ok(Expr::In { column, negated, literals });
                }
                _ => return Err(self.expected("',' or ')' in the list")),
            }
        }
    }

    fn like(&mut self, column: Column, negated: bool) -> Result<Expr, FilterError> {
        let t = self.peek().clone();
        let Tok::Str(pattern) = t.tok else {
            return Err(self.expected(format!("a quoted pattern after '{}like'", if negated { "not " } else { "" })));
        };
        self.bump();
        let mut prefix = String::new();
        let mut wildcard = false;
        let mut chars = pattern.char_indices().peekable();
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' if chars.peek().is_some_and(|(_, n)| *n == '%') => {
                    prefix.push('%');
                    chars.next();
                }
                '%' if i + 1 == pattern.len() => wildcard = true,
                '%' => {
                    return Err(unsupported(
                        self.source,
                        t.at,
                        format!(
                            "like {} has a '%' before its end; only a pattern ending in one '%' \
                             (starts-with) is supported, write \\% for a literal '%'",
                            t.text
                        ),
                    ));
                }
                c => prefix.push(c),
            }
        }
        if wildcard {
            Ok(Expr::StartsWith { column, negated, prefix, at: t.at })
        } else {
            let op = if negated { CmpOp::NotEq } else { CmpOp::Eq };
            Ok(Expr::Compare { column, op, literal: Lit { value: LitValue::Str(prefix), at: t.at } })
        }
    }
}
